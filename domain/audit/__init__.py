"""The audit trail of the control plane: who changed what (old -> new), sealed into a hash chain
per control stream so that an edited or deleted event is found by `tollgate audit verify`."""
