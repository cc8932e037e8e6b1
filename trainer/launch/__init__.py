"""Start the training: in-process on one device or through torch's elastic launcher; the public ``train(config)``;
``python -m trainer.launch`` per node."""
