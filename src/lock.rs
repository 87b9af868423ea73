//! Token lock with fencing (placeholder; filled by the lock work).
