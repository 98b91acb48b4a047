//! Prefix-cache statistics, as vLLM's `PrefixCacheStats`.

/// Counts since the last `make_prefix_cache_stats`. Recorded when a request is admitted
/// (its first successful allocation): `queries` are its tokens, `hits` its cached tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Set when the prefix cache was reset since the last snapshot.
    pub reset: bool,
    pub requests: u64,
    pub queries: u64,
    pub hits: u64,
    pub preempted_requests: u64,
    pub preempted_queries: u64,
    pub preempted_hits: u64,
}

impl PrefixCacheStats {
    /// A preempted request (admitted again) counts only in the `preempted_*` fields.
    pub fn record(&mut self, num_tokens: usize, num_hits: usize, preempted: bool) {
        let (requests, queries, hits) = if preempted {
            (&mut self.preempted_requests, &mut self.preempted_queries, &mut self.preempted_hits)
        } else {
            (&mut self.requests, &mut self.queries, &mut self.hits)
        };
        *requests += 1;
        *queries += num_tokens as u64;
        *hits += num_hits as u64;
    }
}
