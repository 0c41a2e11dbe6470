"""prefire with other libraries' models: one call turns prefire on where the
library has its own activation-checkpointing switch.

* :mod:`prefire.integrations.transformers`: Hugging Face transformers models.
"""
