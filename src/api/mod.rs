//! The projection HTTP API.
