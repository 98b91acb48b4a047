//! The batched scheduler step: the whole contract between a scheduler and the manager.
//!
//! One call appends the tokens sampled in the previous step, allocates for every request of
//! the step in order (looking up admissions' prefixes at their turn, preempting by recompute
//! when asked), and writes everything a paged-attention runtime needs for the scheduled
//! requests. A scheduler keeps only policy: which requests, in which order, the token budget.
//!
//! The step is planned first ([`BlockManager::plan_step`]: every check, nothing changed, the
//! output sizes) and then run ([`PlannedStep::run`]); the plan borrows the manager mutably, so
//! nothing can change it between the two.

use super::{invalid, BlockManager};
use crate::requests::RequestRef;
use crate::{CoreError, CoreResult};

/// The inputs of one batched scheduler step (see [`BlockManager::plan_step`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepInput<'a> {
    /// The requests, in scheduling order: running requests first (in the order they are to be
    /// kept), then admissions.
    pub handles: &'a [i64],
    /// Tokens to compute for each request. Without a `token_budget` these are exact (except
    /// for prefix-lookup admissions, where they are a bound); with one they are upper bounds
    /// (`None`: no bound but the budget).
    pub num_new_tokens: Option<&'a [usize]>,
    /// Prefix-cache hit tokens to take at admission (a multiple of the block size).
    pub num_new_computed_tokens: Option<&'a [usize]>,
    /// True for admissions whose prefix lookup happens at their turn in the step (so they
    /// also hit blocks that earlier requests of the same step just cached).
    pub prefix_lookup: Option<&'a [bool]>,
    pub num_lookahead_tokens: usize,
    /// Accepted tokens to append first: request `i` gets
    /// `new_token_ids[new_token_offsets[i]..new_token_offsets[i + 1]]`.
    pub new_token_ids: &'a [u32],
    pub new_token_offsets: Option<&'a [usize]>,
    /// One entry per row of the previous step: the token sampled for it, appended to its
    /// request before anything else (`None`, or a request removed since: nothing).
    pub sampled_token_ids: Option<&'a [Option<u32>]>,
    /// At most this many tokens in the step; each request gets
    /// `min(bound, tokens it has left to compute, budget left)`, and a request that gets none
    /// is skipped (no row).
    pub token_budget: Option<usize>,
    /// Preemption by recompute, as vLLM: when a request that holds blocks does not fit, the
    /// last request of the step that holds blocks and is not scheduled yet (possibly itself)
    /// is freed, and the allocation is retried. A step that preempted admits nobody.
    pub preempt: bool,
}

/// Output sizes of a step, known before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepSizes {
    /// The most rows (one per request of the step).
    pub num_reqs: usize,
    /// The widest block table among the requests after the step.
    pub max_blocks: usize,
    /// The most tokens the step can schedule.
    pub max_tokens: usize,
}

/// Where a step writes the paged-attention metadata of the scheduled requests, one row per
/// scheduled request in step order.
#[derive(Debug)]
pub struct StepOutput<'a> {
    /// Row-major `[rows, width]`; row `r` holds its request's block ids, padded with 0.
    pub block_table: &'a mut [i32],
    pub width: usize,
    /// `block_id * block_size + offset` of each scheduled token, row after row.
    pub slot_mapping: &'a mut [i32],
    /// Each row's computed tokens after the step (its context length).
    pub seq_lens: &'a mut [i32],
    /// `query_start_loc[r]..query_start_loc[r + 1]` are row `r`'s tokens.
    pub query_start_loc: &'a mut [i32],
    /// The token id of each scheduled token.
    pub input_ids: &'a mut [i64],
    /// The position of each scheduled token in its request.
    pub positions: &'a mut [i64],
    /// Each row's index in the step's input.
    pub req_indices: &'a mut [i32],
    /// Each row's scheduled tokens.
    pub num_new_tokens: &'a mut [i32],
    /// Each row's prefix-cache hit tokens taken by this step (admissions only).
    pub num_new_computed_tokens: &'a mut [i32],
}

/// Owned output buffers, reused step after step (what Python's `StepBuffers` holds).
#[derive(Debug, Clone, Default)]
pub struct StepBuffers {
    pub block_table: Vec<i32>,
    pub width: usize,
    pub slot_mapping: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub req_indices: Vec<i32>,
    pub num_new_tokens: Vec<i32>,
    pub num_new_computed_tokens: Vec<i32>,
}

impl StepBuffers {
    pub fn new(max_num_reqs: usize, max_num_tokens: usize, max_blocks_per_req: usize) -> Self {
        Self {
            block_table: vec![0; max_num_reqs * max_blocks_per_req],
            width: max_blocks_per_req,
            slot_mapping: vec![0; max_num_tokens],
            seq_lens: vec![0; max_num_reqs],
            query_start_loc: vec![0; max_num_reqs + 1],
            input_ids: vec![0; max_num_tokens],
            positions: vec![0; max_num_tokens],
            req_indices: vec![0; max_num_reqs],
            num_new_tokens: vec![0; max_num_reqs],
            num_new_computed_tokens: vec![0; max_num_reqs],
        }
    }

    pub fn output(&mut self) -> StepOutput<'_> {
        StepOutput {
            block_table: &mut self.block_table,
            width: self.width,
            slot_mapping: &mut self.slot_mapping,
            seq_lens: &mut self.seq_lens,
            query_start_loc: &mut self.query_start_loc,
            input_ids: &mut self.input_ids,
            positions: &mut self.positions,
            req_indices: &mut self.req_indices,
            num_new_tokens: &mut self.num_new_tokens,
            num_new_computed_tokens: &mut self.num_new_computed_tokens,
        }
    }
}

impl StepSizes {
    fn check(&self, out: &StepOutput<'_>) -> CoreResult<()> {
        let rows = self.num_reqs;
        let fits = out.width >= self.max_blocks
            && out.block_table.len() >= rows.saturating_mul(out.width)
            && out.slot_mapping.len() >= self.max_tokens
            && out.input_ids.len() >= self.max_tokens
            && out.positions.len() >= self.max_tokens
            && out.seq_lens.len() >= rows
            && out.req_indices.len() >= rows
            && out.num_new_tokens.len() >= rows
            && out.num_new_computed_tokens.len() >= rows
            && out.query_start_loc.len() > rows;
        if fits {
            return Ok(());
        }
        Err(invalid(format!(
            "output buffers too small: this step needs {rows} block-table rows of {} columns, \
             {} token entries (slot_mapping, input_ids, positions), {rows} entries per request \
             and {} query_start_loc entries",
            self.max_blocks,
            self.max_tokens,
            rows + 1
        )))
    }
}

/// What a step did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepResult {
    /// Rows written (scheduled requests).
    pub num_scheduled: usize,
    pub num_scheduled_tokens: usize,
    /// Copy-on-write copies made by this step (not also left for `take_block_copies`).
    pub block_copies: Vec<[u32; 2]>,
    /// Blocks whose cached content this step evicted, in order.
    pub evicted_blocks: Vec<u32>,
    /// Input indices of the requests this step preempted, in order.
    pub preempted: Vec<usize>,
}

/// A checked step, ready to run; holds the manager until it runs or is dropped.
#[derive(Debug)]
pub struct PlannedStep<'m, 'a> {
    manager: &'m mut BlockManager,
    input: StepInput<'a>,
    slots: Vec<usize>,
    /// `(slot, token)` of the previous rows' samples that go to live requests, by slot.
    sampled: Vec<(usize, u32)>,
    sizes: StepSizes,
}

fn same_len(len: usize, n: usize, what: &str) -> CoreResult<()> {
    match len == n {
        true => Ok(()),
        false => Err(invalid(format!("{what} has {len} entries for {n} requests"))),
    }
}

fn entry<T: Copy>(values: Option<&[T]>, i: usize) -> Option<T> {
    values.and_then(|v| v.get(i)).copied()
}

impl BlockManager {
    /// One scheduler step in one call: [`Self::plan_step`], then [`PlannedStep::run`].
    pub fn schedule_step(
        &mut self,
        input: StepInput<'_>,
        out: &mut StepOutput<'_>,
    ) -> CoreResult<StepResult> {
        self.plan_step(input)?.run(out)
    }

    /// Checks a step and computes its output sizes. Changes nothing; every error a step can
    /// raise for its input is raised here.
    pub fn plan_step<'m, 'a>(
        &'m mut self,
        input: StepInput<'a>,
    ) -> CoreResult<PlannedStep<'m, 'a>> {
        let n = input.handles.len();
        let b = self.block_size;
        match input.num_new_tokens {
            Some(counts) => same_len(counts.len(), n, "num_new_tokens")?,
            None if input.token_budget.is_none() => {
                return Err(invalid("num_new_tokens is needed without a token_budget"));
            }
            None => {}
        }
        if let Some(hits) = input.num_new_computed_tokens {
            same_len(hits.len(), n, "num_new_computed_tokens")?;
        }
        if let Some(lookup) = input.prefix_lookup {
            same_len(lookup.len(), n, "prefix_lookup")?;
        }
        match input.new_token_offsets {
            None if !input.new_token_ids.is_empty() => {
                return Err(invalid("new_token_ids needs new_token_offsets"));
            }
            None => {}
            Some(offsets) => {
                let ok = offsets.len() == n + 1
                    && offsets.first() == Some(&0)
                    && offsets.windows(2).all(|w| w.first() <= w.get(1))
                    && offsets.last() == Some(&input.new_token_ids.len());
                if !ok {
                    return Err(invalid(
                        "new_token_offsets must have one entry per request plus one, start at 0, \
                         never decrease and end at len(new_token_ids)",
                    ));
                }
            }
        }
        let sampled = self.sampled_tokens(input.sampled_token_ids)?;
        let mut slots = Vec::with_capacity(n);
        for &handle in input.handles {
            slots.push(self.slot(handle)?);
        }
        let mut seen = slots.clone();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w.first() == w.get(1)) {
            return Err(invalid("a request appears twice in one step"));
        }
        let mut sizes = StepSizes { num_reqs: n, ..StepSizes::default() };
        for (i, &slot) in slots.iter().enumerate() {
            let request = self.request_at(slot)?;
            let own = match input.new_token_offsets {
                Some(o) => entry(Some(o), i + 1).unwrap_or(0) - entry(Some(o), i).unwrap_or(0),
                None => 0,
            };
            let sample = usize::from(sampled.binary_search_by_key(&slot, |&(s, _)| s).is_ok());
            let num_tokens = request.seq.num_tokens() + own + sample;
            self.check_model_len(num_tokens)?;
            let hit_tokens = entry(input.num_new_computed_tokens, i).unwrap_or(0);
            let lookup = entry(input.prefix_lookup, i).unwrap_or(false);
            if lookup && (hit_tokens > 0 || request.holds_blocks()) {
                return Err(invalid(
                    "prefix_lookup is for admissions without num_new_computed_tokens",
                ));
            }
            let bound = entry(input.num_new_tokens, i).unwrap_or(usize::MAX);
            // With a lookup or a budget, `num_new_tokens` is a bound (the hit only lowers it).
            let new = match lookup || input.token_budget.is_some() {
                true => bound
                    .min(num_tokens.saturating_sub(request.num_computed_tokens + hit_tokens))
                    .min(input.token_budget.unwrap_or(usize::MAX)),
                false => bound,
            };
            let may_be_empty = input.token_budget.is_some();
            self.check_allocation(request, num_tokens, new, hit_tokens, may_be_empty)?;
            // A lookup's hit plus its new tokens can reach the whole request.
            let local = request.num_computed_tokens.saturating_add(hit_tokens);
            let (computed, new_slots) = if lookup { (num_tokens, 0) } else { (local, new) };
            let need = self.coordinator.config().num_slots(
                computed,
                new_slots,
                input.num_lookahead_tokens,
            );
            let blocks_after = need.div_ceil(b).max(request.blocks().len() + hit_tokens / b);
            sizes.max_blocks = sizes.max_blocks.max(blocks_after);
            sizes.max_tokens = sizes.max_tokens.saturating_add(new);
        }
        sizes.max_tokens = sizes.max_tokens.min(input.token_budget.unwrap_or(usize::MAX));
        Ok(PlannedStep { manager: self, input, slots, sampled, sizes })
    }

    /// The previous rows' samples as `(slot, token)` by slot, checked against the model
    /// length; rows whose request was removed since are dropped.
    fn sampled_tokens(&self, sampled: Option<&[Option<u32>]>) -> CoreResult<Vec<(usize, u32)>> {
        let Some(sampled) = sampled else { return Ok(Vec::new()) };
        if sampled.len() != self.last_rows.len() {
            return Err(invalid(format!(
                "sampled_token_ids has {} entries for the {} rows of the last step",
                sampled.len(),
                self.last_rows.len()
            )));
        }
        let mut out = Vec::with_capacity(sampled.len());
        for (&handle, token) in self.last_rows.iter().zip(sampled) {
            let (Some(token), Ok(slot)) = (token, self.requests.slot(RequestRef::Handle(handle)))
            else {
                continue;
            };
            self.check_model_len(self.request_at(slot)?.seq.num_tokens() + 1)?;
            out.push((slot, *token));
        }
        out.sort_unstable_by_key(|&(slot, _)| slot);
        Ok(out)
    }
}

impl PlannedStep<'_, '_> {
    pub fn sizes(&self) -> StepSizes {
        self.sizes
    }

    /// Runs the step: appends the sampled and new tokens, allocates request after request
    /// (stopping at the first that does not fit, after preempting where allowed) and writes
    /// the scheduled rows into `out`. Fails, changing nothing, only if `out` is too small.
    pub fn run(self, out: &mut StepOutput<'_>) -> CoreResult<StepResult> {
        self.sizes.check(out)?;
        let m = self.manager;
        let input = self.input;
        for &(slot, token) in &self.sampled {
            if let Some(request) = m.requests.get_mut(slot) {
                request.seq.append_token_ids(&[token]);
            }
        }
        if let Some(offsets) = input.new_token_offsets {
            for (i, &slot) in self.slots.iter().enumerate() {
                let (Some(&lo), Some(&hi)) = (offsets.get(i), offsets.get(i + 1)) else { continue };
                let tokens = input.new_token_ids.get(lo..hi).unwrap_or_default();
                if let Some(request) = m.requests.get_mut(slot) {
                    request.seq.append_token_ids(tokens);
                }
            }
        }
        m.last_rows.clear();
        let copies_before = m.copies.len();
        m.coordinator.record_evictions();
        let scheduled = m.allocate_rows(input, &self.slots, out);
        let evicted_blocks = m.coordinator.stop_recording_evictions();
        let mut result = scheduled?;
        // The step hands its own copies over; earlier ones stay for `take_block_copies`.
        result.block_copies = m.copies.split_off(copies_before.min(m.copies.len()));
        result.evicted_blocks = evicted_blocks;
        Ok(result)
    }
}

impl BlockManager {
    /// The allocation loop of [`PlannedStep::run`].
    fn allocate_rows(
        &mut self,
        input: StepInput<'_>,
        slots: &[usize],
        out: &mut StepOutput<'_>,
    ) -> CoreResult<StepResult> {
        let b = self.block_size;
        let n = slots.len();
        let mut result = StepResult::default();
        let mut budget = input.token_budget;
        let mut preempted = vec![false; n];
        if let Some(first) = out.query_start_loc.first_mut() {
            *first = 0;
        }
        'requests: for (i, &slot) in slots.iter().enumerate() {
            if preempted.get(i) == Some(&true) {
                continue;
            }
            let request = self.request_at(slot)?;
            let holds = request.running;
            if !holds && !result.preempted.is_empty() {
                break; // a step that preempted admits nobody (vLLM)
            }
            let mut hit_tokens = entry(input.num_new_computed_tokens, i).unwrap_or(0);
            let mut hits = Vec::new();
            let lookup = entry(input.prefix_lookup, i).unwrap_or(false);
            if lookup {
                hits = self.computed_blocks(request)?;
                hit_tokens = hits.len() * b;
            } else if hit_tokens > 0 {
                hits = self.computed_blocks(request)?;
                if hits.len() < hit_tokens / b {
                    break; // an earlier request of this step evicted part of the prefix
                }
                hits.truncate(hit_tokens / b);
            }
            let left = request.seq.num_tokens() - request.num_computed_tokens - hit_tokens;
            let mut new = entry(input.num_new_tokens, i).unwrap_or(usize::MAX);
            if lookup || budget.is_some() {
                new = new.min(left).min(budget.unwrap_or(usize::MAX));
            }
            if budget.is_some() && new == 0 {
                continue; // nothing to compute, or no budget left
            }
            while !self.allocate_in(slot, new, hit_tokens, &hits, input.num_lookahead_tokens)? {
                if !(input.preempt && holds) {
                    break 'requests;
                }
                let holds_at = |j: usize| {
                    preempted.get(j) == Some(&false)
                        && slots
                            .get(j)
                            .and_then(|&s| self.requests.get(s))
                            .is_some_and(|r| r.running)
                };
                let victim = (i..n).rev().find(|&j| holds_at(j)).ok_or(CoreError::Internal(
                    "a running request that does not fit found no victim",
                ))?;
                let victim_slot = *slots.get(victim).ok_or(CoreError::Internal("victim"))?;
                self.free_slot(victim_slot);
                if let Some(p) = preempted.get_mut(victim) {
                    *p = true;
                }
                result.preempted.push(victim);
                if victim == i {
                    continue 'requests;
                }
            }
            self.write_row(slot, i, new, hit_tokens, &mut result, out)?;
            if let Some(left) = &mut budget {
                *left -= new;
            }
        }
        Ok(result)
    }

    /// Writes row `result.num_scheduled` for the request in `slot` (input index `index`),
    /// which has just been allocated `new` tokens.
    fn write_row(
        &mut self,
        slot: usize,
        index: usize,
        new: usize,
        hit_tokens: usize,
        result: &mut StepResult,
        out: &mut StepOutput<'_>,
    ) -> CoreResult<()> {
        let b = self.block_size;
        let request = self.request_at(slot)?;
        let row = result.num_scheduled;
        let start = row * out.width;
        let cells = out
            .block_table
            .get_mut(start..start + out.width)
            .ok_or(CoreError::Internal("block table row out of bounds"))?;
        cells.fill(0);
        cells.iter_mut().zip(request.blocks()).for_each(|(cell, &block)| *cell = block as i32);
        let end = request.num_computed_tokens;
        let first = result.num_scheduled_tokens;
        let tokens = first..first + new;
        let (Some(slots), Some(ids), Some(positions)) = (
            out.slot_mapping.get_mut(tokens.clone()),
            out.input_ids.get_mut(tokens.clone()),
            out.positions.get_mut(tokens),
        ) else {
            return Err(CoreError::Internal("token outputs out of bounds"));
        };
        let scheduled = (end - new..end).zip(request.seq.tokens_in(end - new, end));
        for (k, (position, token)) in scheduled.enumerate() {
            let block = *request
                .blocks()
                .get(position / b)
                .ok_or(CoreError::Internal("a scheduled token has no block"))?;
            if let (Some(s), Some(t), Some(p)) =
                (slots.get_mut(k), ids.get_mut(k), positions.get_mut(k))
            {
                *s = (block as usize * b + position % b) as i32;
                *t = i64::from(token);
                *p = position as i64;
            }
        }
        let per_row = [
            (&mut *out.seq_lens, end),
            (&mut *out.req_indices, index),
            (&mut *out.num_new_tokens, new),
            (&mut *out.num_new_computed_tokens, hit_tokens),
        ];
        for (array, value) in per_row {
            if let Some(cell) = array.get_mut(row) {
                *cell = value as i32;
            }
        }
        result.num_scheduled_tokens += new;
        if let Some(q) = out.query_start_loc.get_mut(row + 1) {
            *q = result.num_scheduled_tokens as i32;
        }
        result.num_scheduled += 1;
        self.last_rows.push(self.requests.handle(slot));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{HashAlgo, DEFAULT_SEED};
    use crate::{BlockHasher, ManagerConfig, RequestKeys};
    use std::sync::Arc;

    /// `n` running requests of 8 tokens holding 2 blocks each (block size 4).
    fn running(num_blocks: usize, n: u32) -> (BlockManager, Vec<i64>) {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, 4, DEFAULT_SEED.to_owned()).unwrap();
        let config = ManagerConfig { num_blocks, ..ManagerConfig::default() };
        let mut m = BlockManager::new(config, Arc::new(hasher)).unwrap();
        let handles: Vec<i64> = (0..n)
            .map(|i| {
                let prompt: Vec<u32> = (0..8).map(|k| 10 * i + k).collect();
                m.add_request(&format!("r{i}"), &prompt, RequestKeys::default()).unwrap()
            })
            .collect();
        let input = StepInput { handles: &handles, token_budget: Some(100), ..Default::default() };
        let result = m.schedule_step(input, &mut StepBuffers::new(8, 100, 8).output()).unwrap();
        assert_eq!(result.num_scheduled, n as usize);
        (m, handles)
    }

    #[test]
    fn preemption_takes_the_newest_running_request_and_blocks_admissions() {
        let (mut m, mut handles) = running(9, 4);
        handles.push(m.add_request("late", &[99; 4], RequestKeys::default()).unwrap());
        let lookup = [false, false, false, false, true];
        let sampled = [Some(5), Some(6), Some(7), Some(8)];
        let input = StepInput {
            handles: &handles,
            prefix_lookup: Some(&lookup),
            sampled_token_ids: Some(&sampled),
            token_budget: Some(100),
            preempt: true,
            ..Default::default()
        };
        let mut buffers = StepBuffers::new(8, 100, 8);
        let result = m.schedule_step(input, &mut buffers.output()).unwrap();
        assert_eq!(result.preempted, [3, 2]);
        assert_eq!(result.num_scheduled, 2);
        assert_eq!(buffers.req_indices.get(..2), Some(&[0, 1][..]));
        assert_eq!(buffers.input_ids.get(..2), Some(&[5, 6][..]));
        assert_eq!(buffers.positions.get(..2), Some(&[8, 8][..]));
        assert!(m.block_ids(handles[2]).unwrap().is_empty());
        assert_eq!(m.sequence(handles[3]).unwrap().last_token_id(), 8);
    }

    #[test]
    fn a_planned_step_that_does_not_run_changes_nothing() {
        let (mut m, handles) = running(20, 2);
        let sampled = [Some(5), Some(6)];
        let input = StepInput {
            handles: &handles,
            sampled_token_ids: Some(&sampled),
            token_budget: Some(1),
            ..Default::default()
        };
        let planned = m.plan_step(input).unwrap();
        assert_eq!(planned.sizes().max_tokens, 1);
        let mut small = StepBuffers::new(1, 1, 8);
        assert!(matches!(planned.run(&mut small.output()), Err(CoreError::InvalidArgument(_))));
        assert_eq!(m.sequence(handles[0]).unwrap().num_tokens(), 8);
        let result = m.schedule_step(input, &mut StepBuffers::new(2, 1, 8).output()).unwrap();
        assert_eq!((result.num_scheduled, result.num_scheduled_tokens), (1, 1));
        assert_eq!(m.sequence(handles[1]).unwrap().num_tokens(), 9); // both samples are in
        assert_eq!(m.num_computed_tokens(handles[1]).unwrap(), 8); // but the budget ran out
    }
}
