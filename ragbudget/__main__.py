from ragbudget.cli import main

main()
