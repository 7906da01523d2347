"""Names of the structured audit events the manager logs (one place, so replay tools agree)."""

TRANSITION = "lifecycle.transition"        # rid, trigger, src, dst
CHUNK_ENQUEUED = "lifecycle.chunk_enqueued"  # rid, row, ack_id, start, end, pages, first_hash, last_hash
CHUNK_LANDED = "lifecycle.chunk_landed"    # rid, row, ack_id, start, end, op_id, latency_s
HOST_SHORT = "lifecycle.host_short"        # rid, row, start, end
STORED = "lifecycle.stored"                # rid, op_id, ack_id, pages, first_hash, last_hash
RELEASED = "lifecycle.released"            # rid, row, ranges, slots
LEAKED = "lifecycle.leaked"                # rid, row, slots, state
REFUSED = "lifecycle.refused"              # rid, trigger, state, reason

ALL = (TRANSITION, CHUNK_ENQUEUED, CHUNK_LANDED, HOST_SHORT, STORED, RELEASED, LEAKED, REFUSED)
