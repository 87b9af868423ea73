//! Runtime configuration (placeholder).
