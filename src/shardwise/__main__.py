from shardwise.cli import main

main()
