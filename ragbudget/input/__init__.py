"""Files in: scanning, reading and decoding, page furniture, token-bounded chunks, duplicates."""
