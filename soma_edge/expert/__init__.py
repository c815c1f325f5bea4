"""One expert: its parameters and its ONNX graphs.

- `params`: the flat weight vector and its named views (`layout`, `init`, `count`);
- `builder`: building graphs node by node (`GraphBuilder`), trees of at most MAX_FANIN, and the delta rule's
  decoder gradients (`decoder_grads`), shared by every graph that needs them;
- `graph`: the ONNX LSTM graphs (`build`: loss, train, logprobs, stream) and the router's featurizer;
- `population_graph`: a step's clean forward and 2K perturbed members in one graph (`build_population`);
- `update_graph`: the SPSA update as a graph (`build_update`), the host's arithmetic node for node;
- `cuda_kernels`: the ops ONNX Runtime's CUDA EP implements, and a check of a graph against them;
- `steps`: an expert's steps as a run's config defines them (`stepper`, `batches`, `replay`).

Depends on the basics, corpus/ and spsa/.
"""
