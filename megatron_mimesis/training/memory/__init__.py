"""The memory plan: what one GPU of a run holds, per pipeline stage, computed from the real model code.

``world.py`` builds one rank of the job's world in this process (torch's fake process group); ``states.py`` builds
that rank's model shard on fake tensors and counts parameters, fp32 main gradients and optimizer states exactly;
``saved.py`` counts the tensors autograd keeps, ``gpu_kernels.py`` declares what the GPU kernels keep where the CPU
modules differ, and ``activations.py`` measures each layer type with them; ``plan.py`` puts it together with the
schedule's micro-batches in flight, the fused loss's backward temporaries and the stated allowances, checks it
against the GPU and renders the table every stage's ``--dry-run`` and ``mimesis-plan`` print.
"""
