from llmcli.cli import main

main()
