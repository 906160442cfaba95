"""Device kernels of the adapters: recurrences that return the state after every token
(`gated_delta`, `ssm`) and a verify forward's attention (`verify_attention`), each a CUDA and
a Metal kernel with an ops path that gives the same results elsewhere (the CPU). They import
nothing else of the adapters."""
