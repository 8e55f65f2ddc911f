"""The training run: its schema and the rooms of its lifecycle, above the library's pure pieces.

    experiment_config  every key of a run, its default, meaning and rule (`ExperimentConfig`, one-line errors)
    factories          config -> model config, optimizer, train state, compiled steps, checkpointer
    run_checks         a run's refusals before anything is written (config vs tables and mesh, batch vs tables)
    plan               the run's steps compiled on abstract arrays (a TPU topology too): memory, cost, fit
    trainer            the loop: `train_and_evaluate(config, workdir)`
    evaluators         loss / attention / BLEU evaluations; early_stopping, budget: the rules that stop a run
    checkpoint         orbax checkpoints, exact resume, averaging; trained / imported_workdir: loading a run
    train_log, trackers, profiling, stop_signal, owner_lock: what the loop writes, traces, heeds and holds

Nothing below this package imports it (tests/test_layering.py); the programs in `experiments/` and
`benchmarks/` stand on it.
"""
