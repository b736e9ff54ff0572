"""Context parallelism: the sequence split over ranks (layout), attention across the split by
passing K/V around a ring (ring_attention) or by trading the sequence split for a head split
(ulysses)."""
