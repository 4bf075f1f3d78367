//! The work-session KV writer.
