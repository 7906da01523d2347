"""Names of the structured audit events the manager logs (one place, so replay tools agree).

Events about one request carry ``rid``, ``row`` and ``gen`` (its lifecycle generation: 0, then +1
per ``readmit``), except ``stored`` and ``refused`` (``rid`` only). ``lifecycle_tools.replay`` checks a log.
"""

TRANSITION = "lifecycle.transition"        # rid, trigger, src, dst
CHUNK_ENQUEUED = "lifecycle.chunk_enqueued"  # rid, row, ack_id, start, end, pages, first_hash, last_hash
CHUNK_LANDED = "lifecycle.chunk_landed"    # rid, row, ack_id, start, end, op_id, latency_s
HOST_SHORT = "lifecycle.host_short"        # rid, row, start, end
STORED = "lifecycle.stored"                # rid, op_id, ack_id, pages, first_hash, last_hash
RELEASED = "lifecycle.released"            # rid, row, ranges, slots, committed, allocated
LEAKED = "lifecycle.leaked"                # rid, row, slots, state
REFUSED = "lifecycle.refused"              # rid, trigger, state, reason
COPY_FAILED = "lifecycle.copy_failed"      # rid, row, ack_id, start, end (never stored)
COPY_EXPIRED = "lifecycle.copy_expired"    # rid, row, ack_id, start, end, slots (quarantined)
EXPIRED_COPY_ENDED = "lifecycle.expired_copy_ended"  # rid, ack_id, slots_freed

ALL = (TRANSITION, CHUNK_ENQUEUED, CHUNK_LANDED, HOST_SHORT, STORED, RELEASED, LEAKED, REFUSED,
       COPY_FAILED, COPY_EXPIRED, EXPIRED_COPY_ENDED)
HOST_SHORT_SUMMARY = "lifecycle.host_short_summary"  # refused, total, interval_s (a WARNING, rate-limited)
ABANDONED = "lifecycle.abandoned"          # pending, acks, copies, held_slots, quarantined_slots, why (shutdown(force=True))
DRAIN_STOPPED = "lifecycle.drain_stopped"  # error (shutdown(force=True): a progress check raised while draining)
BAD_RELEASE_ROW = "lifecycle.bad_release_row"  # rid, row, gen, ranges, problem, counts (an ERROR, rate-limited:
#                                                 a released device row's slot ids found bad on the device)
RELEASE_CHECKS_UNREAD = "lifecycle.release_checks_unread"  # unread, why (device-side release checks dropped unread)
ALL = ALL + (HOST_SHORT_SUMMARY, ABANDONED, DRAIN_STOPPED, BAD_RELEASE_ROW, RELEASE_CHECKS_UNREAD)
