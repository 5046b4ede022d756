"""The trace collector for Hugging Face MoE models (extra ``collect``)."""
