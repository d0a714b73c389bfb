"""Model building blocks shared by the model files."""
