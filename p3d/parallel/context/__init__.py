"""Context parallelism: each sequence split over the cp ranks of a dp replica, attention across them by
all-gathering keys and values (docs/context.md).

``chunks``: which tokens a cp rank holds (2 of the 2 cp chunks of every sequence, head and tail) and cutting a
batch to them; ``attention``: the causal attention of a rank's queries against every rank's keys and values, an
autograd Function over the cp group (``ring``: the same around a ring); ``routing``: what a mixture of experts needs
of the whole sequence (its balancing loss's statistics, a capacity's positions), over the cp group.
"""
