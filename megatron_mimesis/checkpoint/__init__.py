"""Checkpoints, one floor above the models and below the trainer: the trainer's state saved and resumed
(``trainer_state.py``), atomic writing and publication (``writer.py``), integrity records and the restricted
unpickler (``integrity.py``), the reader that never runs a file (``reader.py``), and HF <-> dist conversion
(``conversion.py``; the import's tensor-by-tensor source in ``hf_import.py``)."""
