"""The only code that talks to torch.distributed: process groups, strategies, the ledger, sharded checkpoints."""
