"""What autograd keeps for the backward pass, in bytes, as the real modules run.

Activation memory is the tensors the autograd graph holds from the forward to the backward pass. Every one of them
passes through ``torch.autograd.graph.saved_tensors_hooks``' pack hook (ops' saved inputs and outputs,
``ctx.save_for_backward`` of custom functions), so counting there measures it without reading any module's code.
A saved view keeps its whole base alive (the storage is what stays allocated), so storages are counted, each once
however many saved tensors share it. A tensor can be saved and freed again before the forward ends (a graph branch
that nothing downstream uses): it costs nothing at the backward pass, and its address may be reused by a later saved
tensor, so only storages that a saved tensor still holds when the context exits are counted; without that rule the
count depended on the allocator's history (which addresses malloc handed out again). Parameters are not activations
(they are counted as parameters) and tensors shared by every layer (the rotary frequencies) are counted once by
whoever owns them, so both can be excluded.

Where the GPU runs a kernel whose saved set differs from the CPU module's (Transformer Engine, flash-linear-attention;
``gpu_kernels.py``), the stand-in returns an output of the kernel's shape and declares the tensors the kernel saves with
:meth:`SavedTensors.keep` (existing tensors) or :meth:`SavedTensors.keep_new` (ones the kernel allocates, such as a
norm's per-row statistics), so the count stays one sum over storages.
"""

import itertools
import weakref

import torch

_synthetic = itertools.count(-1, -1)  # keys of declared-only storages: negative, never a real address


class SavedTensors:
    """Context that counts the storages saved for backward while it is active (``bytes``, ``storages``); the
    innermost active one is :meth:`current`, which the GPU-kernel stand-ins declare their saved sets to."""

    _active: list["SavedTensors"] = []

    @classmethod
    def current(cls) -> "SavedTensors":
        if not cls._active:
            raise RuntimeError("no SavedTensors context is active")
        return cls._active[-1]

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self._holders: dict[int, list[weakref.ref]] = {}  # storage key -> the saved tensors that hold it
        self._kept: list[torch.Tensor] = []  # declared tensors stay alive, so their addresses are not reused

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def keep(self, *tensors: torch.Tensor) -> None:
        """Count ``tensors`` as saved (a GPU kernel's saved inputs or outputs)."""
        for t in tensors:
            self._pack(t)
            self._kept.append(t)

    def keep_new(self, shape, dtype: torch.dtype) -> None:
        """Count a tensor of ``shape`` and ``dtype`` that a GPU kernel allocates and saves."""
        self.storages[next(_synthetic)] = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and storage.nbytes():
            self.storages[key] = storage.nbytes()
            self._holders.setdefault(key, []).append(weakref.ref(tensor))
        return tensor

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        SavedTensors._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        SavedTensors._active.remove(self)
        self._hooks.__exit__(*exc)
        held = {key for key, refs in self._holders.items() if any(ref() is not None for ref in refs)}
        self.storages = {key: n for key, n in self.storages.items() if key < 0 or key in held}
        self._holders.clear()
