"""The checkpoint layout: how a rank's state (model, optim, ema) sits in the sharded checkpoint (torchtitan's
CheckpointManager of stateful parts). DCP reshards DTensors and plain tensors alike, so most strategies write what
they hold as it is; ZeRO-1 holds its optimizer's partition (sharding.py), and replicas that differ between
synchronisations write their own state under their own name (local_updates.py)."""


class CheckpointLayout:
    """What a rank holds is what it writes, under the same names on every rank."""

    def local_optimizer(self, opt):
        """The optimizer whose state this rank holds."""
        return opt

    def arrange(self, held: dict) -> dict:
        """This rank's held state as it is laid out in the checkpoint, around the same tensors."""
        return held

    def resumed(self) -> None:
        """Called once a checkpoint has been read into `arrange`'s tensors."""
