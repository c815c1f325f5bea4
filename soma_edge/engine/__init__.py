"""The expert on ONNX Runtime.

- `runtime`: sessions (`make_session`), what a device asks ORT for (`plan`), the CUDA libraries, where ORT
  placed the nodes (`placement`);
- `evaluator`: the loss evaluators SPSA calls (`LossEvaluator`, `evaluator_for`, `choose_evaluator`);
- `population`: the population evaluator (`PopulationEvaluator`) and its noise inputs;
- `resident`: an expert whose weights and optimizer state stay on the device (`Resident`);
- `capture`: a resident's steps at fixed addresses, captured as CUDA graphs (`Captured`);
- `numerics`: how closely two honest evaluations of one loss agree (`DELTA`).

Depends on the basics, spsa/ and expert/. The deploy path (export/) uses `runtime` alone, without onnx.
"""
