from ragbudget.cli.commands import main

main()
