//! Work-session aggregation (pure).
