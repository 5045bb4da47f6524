"""Context parallelism (the long-context issue): each sequence split over cp ranks, attention across them by
passing keys and values. Empty until that issue lands."""
