//! Scheduler configuration and its validation.
//!
//! A [`SchedulerConfig`] that passed [`SchedulerConfig::validate`] never makes the
//! scheduler panic; [`super::Scheduler::new`] validates before building anything.

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    /// First come, first served; the last-arrived running request is preempted first.
    #[default]
    Fcfs,
    /// Lower `priority` value first (FCFS among equals); the lowest-priority running request
    /// is preempted first, and a waiting request may preempt a strictly lower-priority one.
    Priority,
}

/// Shapes and limits of the scheduler.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Most sequences in one step (and in the running batch when admitting).
    pub max_num_seqs: usize,
    /// Most tokens in one step, summed over sequences.
    pub max_num_batched_tokens: usize,
    /// Most tokens (prompt + output) per sequence.
    pub max_model_len: usize,
    /// Split long prompts over several steps. When off, a prompt runs whole in one step.
    pub enable_chunked_prefill: bool,
    /// Reuse computed full blocks across requests with equal prefixes.
    pub enable_prefix_caching: bool,
    /// Admission and preemption order.
    pub policy: SchedulingPolicy,
    /// Most requests in the waiting queue; more are refused with `QueueFull`.
    pub max_waiting: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            policy: SchedulingPolicy::Fcfs,
            max_waiting: 4096,
        }
    }
}

/// A configuration field out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid scheduler config: {field}: {message}")]
pub struct ConfigError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong, including the value received.
    pub message: String,
}

impl SchedulerConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("max_waiting", self.max_waiting),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(ConfigError { field, message: "must be at least 1, got 0".into() });
            }
        }
        if self.num_blocks >= u32::MAX as usize {
            return Err(ConfigError {
                field: "num_blocks",
                message: format!("must be below {}, got {}", u32::MAX, self.num_blocks),
            });
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            // Otherwise a full batch of decode rows cannot run in one step and the tail starves.
            return Err(ConfigError {
                field: "max_num_batched_tokens",
                message: format!(
                    "must be at least max_num_seqs ({}), got {}",
                    self.max_num_seqs, self.max_num_batched_tokens
                ),
            });
        }
        if self.block_size > 1024 {
            return Err(ConfigError {
                field: "block_size",
                message: format!("must be at most 1024, got {}", self.block_size),
            });
        }
        Ok(())
    }

    /// Tokens the whole pool can hold.
    pub fn pool_tokens(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_each_zero_field_is_named() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
        let zeroed: Vec<(SchedulerConfig, &str)> = vec![
            (SchedulerConfig { block_size: 0, ..Default::default() }, "block_size"),
            (SchedulerConfig { num_blocks: 0, ..Default::default() }, "num_blocks"),
            (SchedulerConfig { max_num_seqs: 0, ..Default::default() }, "max_num_seqs"),
            (SchedulerConfig { max_num_batched_tokens: 0, ..Default::default() }, "max_num_batched_tokens"),
            (SchedulerConfig { max_model_len: 0, ..Default::default() }, "max_model_len"),
            (SchedulerConfig { max_waiting: 0, ..Default::default() }, "max_waiting"),
            (SchedulerConfig { block_size: 4096, ..Default::default() }, "block_size"),
            (
                SchedulerConfig { max_num_seqs: 64, max_num_batched_tokens: 63, ..Default::default() },
                "max_num_batched_tokens",
            ),
            (SchedulerConfig { num_blocks: u32::MAX as usize, ..Default::default() }, "num_blocks"),
        ];
        for (c, field) in zeroed {
            assert_eq!(c.validate().expect_err(field).field, field);
        }
    }
}
