//! Model file formats (placeholder until the formats work lands).
