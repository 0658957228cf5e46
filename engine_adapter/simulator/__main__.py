from tollgate_llm.engine_adapter.simulator.cli import main

if __name__ == "__main__":
    main()
