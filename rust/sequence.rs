//! Matching a plain sequence of FQNs (offline: names read from a checkpoint index, say), one name
//! at a time, so names can stream in.
//!
//! Such lists come grouped (`…experts.203`, `…experts.203.gate_proj`, …), so the DFA resumes from
//! the state after the longest segment prefix a name shares with the previous one, as the tree
//! walk does from a parent, instead of reading every name from its first byte.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::matcher::{DfaState, MatchError, Matcher, PatternSet};
use crate::walk::TreeIndex;

/// Each thread must have this many names to match: it must repay its start.
const MIN_NAMES_PER_THREAD: usize = 1 << 16;
/// At most this many threads at once: past it, merging and memory bandwidth take over.
const MAX_THREADS: usize = 8;
/// Threads take the list in chunks of this many names, each the next chunk nobody took, so a
/// thread slowed down (its core taken by another task) leaves its share to the others.
const CHUNK: usize = 1 << 15;

/// Every match of a list of names as flat arrays (for names by the million, where a list per name
/// would cost more than the matching).
#[derive(Default)]
pub struct IndexHits {
    /// The position of the name of every match, ascending.
    pub names: Vec<u32>,
    /// The pattern of every match, ascending within each name.
    pub patterns: Vec<u32>,
    /// How many names each pattern matched.
    pub counts: Vec<u32>,
}

impl IndexHits {
    /// Matches the `count` names that `name_at` reads on at most `threads` threads side by side
    /// (each on a matcher of its own, taking chunks of the list in turn), and joins the chunks'
    /// hits in order. `None` when `name_at` could not read some name.
    pub fn of<'n>(
        set: &PatternSet,
        count: usize,
        name_at: impl Fn(usize) -> Option<&'n str> + Sync,
        threads: usize,
    ) -> Result<Option<IndexHits>, MatchError> {
        let threads = threads
            .clamp(1, MAX_THREADS)
            .min(count / MIN_NAMES_PER_THREAD)
            .max(1);
        if threads == 1 {
            return set.with_matcher(|m| run_hits(set, 0..count, &name_at, m));
        }
        let chunk_count = count.div_ceil(CHUNK);
        let next_chunk = AtomicUsize::new(0);
        // Each thread's chunks, or `None` when a name could not be read.
        let take_chunks = |matcher: &mut Matcher<'_>| {
            let mut done = Vec::new();
            loop {
                let chunk = next_chunk.fetch_add(1, Ordering::Relaxed);
                if chunk >= chunk_count {
                    return Ok(Some(done));
                }
                let start = chunk * CHUNK;
                let Some(hits) = run_hits(set, start..count.min(start + CHUNK), &name_at, matcher)?
                else {
                    // No thread needs to go on.
                    next_chunk.store(chunk_count, Ordering::Relaxed);
                    return Ok(None);
                };
                done.push((chunk, hits));
            }
        };
        let take_chunks = &take_chunks;
        let per_thread = std::thread::scope(|scope| -> Result<_, MatchError> {
            let others: Vec<_> = (1..threads)
                .map(|_| scope.spawn(move || set.with_new_matcher(take_chunks)))
                .collect();
            let mut per_thread = vec![set.with_matcher(take_chunks)?];
            for other in others {
                per_thread.push(other.join().map_err(|_| {
                    MatchError::Automaton("a matching thread stopped".to_owned())
                })??);
            }
            Ok(per_thread)
        })?;
        let Some(per_thread) = per_thread.into_iter().collect::<Option<Vec<_>>>() else {
            return Ok(None);
        };
        let mut chunks: Vec<(usize, IndexHits)> = per_thread.into_iter().flatten().collect();
        chunks.sort_unstable_by_key(|&(chunk, _)| chunk);
        let matches = chunks.iter().map(|(_, hits)| hits.names.len()).sum();
        let mut joined = IndexHits {
            names: Vec::with_capacity(matches),
            patterns: Vec::with_capacity(matches),
            counts: vec![0; set.len()],
        };
        for (_, hits) in chunks {
            joined.names.extend_from_slice(&hits.names);
            joined.patterns.extend_from_slice(&hits.patterns);
            for (count, more) in joined.counts.iter_mut().zip(&hits.counts) {
                *count += more;
            }
        }
        Ok(Some(joined))
    }
}

/// Why `IndexHits::of_names` found nothing: the matcher failed, or a name could not be read.
#[derive(Debug)]
pub enum HitsError<E> {
    Match(MatchError),
    Read(E),
}

impl IndexHits {
    /// The names read in place where `in_place` reads every one of them, matched on up to
    /// `threads` threads; else (a name it cannot read) on one thread, over the names `read` gives.
    pub fn of_names<'n, E>(
        set: &PatternSet,
        count: usize,
        in_place: Option<impl Fn(usize) -> Option<&'n str> + Sync>,
        read: impl FnOnce() -> Result<Vec<&'n str>, E>,
        threads: usize,
    ) -> Result<IndexHits, HitsError<E>> {
        if let Some(in_place) = in_place {
            if let Some(found) =
                IndexHits::of(set, count, in_place, threads).map_err(HitsError::Match)?
            {
                return Ok(found);
            }
        }
        let names = read().map_err(HitsError::Read)?;
        let found =
            IndexHits::of(set, names.len(), |i| Some(names[i]), 1).map_err(HitsError::Match)?;
        found.ok_or_else(|| {
            HitsError::Match(MatchError::Automaton("a name could not be read".to_owned()))
        })
    }
}

/// The hits of the names at `positions` (`None` when one cannot be read).
fn run_hits<'n>(
    set: &PatternSet,
    positions: std::ops::Range<usize>,
    name_at: &impl Fn(usize) -> Option<&'n str>,
    matcher: &mut Matcher<'_>,
) -> Result<Option<IndexHits>, MatchError> {
    let mut hits = IndexHits {
        counts: vec![0; set.len()],
        ..IndexHits::default()
    };
    let mut sequence = SequenceMatcher::default();
    for position in positions {
        let Some(name) = name_at(position) else {
            return Ok(None);
        };
        let before = hits.patterns.len();
        sequence.matches(name, matcher, &mut hits.patterns)?;
        for &pattern in &hits.patterns[before..] {
            hits.counts[pattern as usize] += 1;
        }
        let matched = hits.patterns.len() - before;
        hits.names
            .extend(std::iter::repeat(position as u32).take(matched));
    }
    Ok(Some(hits))
}

/// Answers names in sequence, remembering where the DFA stood after each segment of the last one.
#[derive(Default)]
pub struct SequenceMatcher<'n> {
    previous: &'n str,
    /// `(offset, DFA state there)` just after each separator of the previous name, and at its end.
    boundaries: Vec<(usize, Option<DfaState>)>,
}

impl<'n> SequenceMatcher<'n> {
    /// Appends to `out` the ascending indices of the patterns matching `name`.
    pub fn matches(
        &mut self,
        name: &'n str,
        matcher: &mut Matcher<'_>,
        out: &mut Vec<u32>,
    ) -> Result<(), MatchError> {
        let common = common_prefix(self.previous.as_bytes(), name.as_bytes());
        while self
            .boundaries
            .last()
            .is_some_and(|&(offset, _)| offset > common)
        {
            self.boundaries.pop();
        }
        let (offset, state) = match self.boundaries.last() {
            Some(&(offset, state)) if matcher.is_current(state) => (offset, state),
            _ => {
                // No shared segment, or the DFA cache was cleared since: start over.
                self.boundaries.clear();
                (0, matcher.start()?)
            }
        };
        let boundaries = &mut self.boundaries;
        let state = matcher.advance_segments(state, &name.as_bytes()[offset..], |end, state| {
            boundaries.push((offset + end, state));
        })?;
        // The whole name is a prefix too: `…experts.7.gate_proj` resumes after `…experts.7`.
        if state.is_some()
            && self
                .boundaries
                .last()
                .map_or(true, |&(end, _)| end < name.len())
        {
            self.boundaries.push((name.len(), state));
        }
        self.previous = name;
        matcher.finish(name, state, out)
    }
}

/// Builds the offline form of a walk's index: each name its own module. Pruned, it records only
/// the names that match, as a pruned walk does.
pub struct NameIndexer<'n> {
    index: TreeIndex,
    prune: bool,
    sequence: SequenceMatcher<'n>,
    scratch: Vec<u32>,
}

impl<'n> NameIndexer<'n> {
    pub fn new(prune: bool) -> NameIndexer<'n> {
        NameIndexer {
            index: TreeIndex {
                complete: true,
                ..TreeIndex::default()
            },
            prune,
            sequence: SequenceMatcher::default(),
            scratch: Vec::new(),
        }
    }

    pub fn push(&mut self, name: &'n str, matcher: &mut Matcher<'_>) -> Result<(), MatchError> {
        self.scratch.clear();
        self.sequence.matches(name, matcher, &mut self.scratch)?;
        if self.prune && self.scratch.is_empty() {
            self.index.complete = false;
            return Ok(());
        }
        let at = self.index.names.push(name);
        self.index.name_module.push(at);
        self.index.module_first_name.push(at);
        self.index
            .hits
            .extend(self.scratch.iter().map(|&p| (at, p)));
        Ok(())
    }

    pub fn finish(self) -> TreeIndex {
        self.index
    }
}

/// The length of the longest common prefix of `a` and `b`, compared eight bytes at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let length = a.len().min(b.len());
    let (a, b) = (&a[..length], &b[..length]);
    let mut done = 0;
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        let differ = u64::from_le_bytes(x.try_into().unwrap_or_default())
            ^ u64::from_le_bytes(y.try_into().unwrap_or_default());
        if differ != 0 {
            return done + (differ.trailing_zeros() / 8) as usize;
        }
        done += 8;
    }
    done + a[done..]
        .iter()
        .zip(&b[done..])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::PatternSet;

    #[test]
    fn names_read_in_place_are_matched_unless_one_cannot_be_read() {
        let Ok(set) = PatternSet::new(&["a.*", "b"]) else {
            panic!("the patterns compile")
        };
        let names = ["a.x", "b", "c"];
        let read = || Ok::<_, ()>(names.to_vec());
        let all = IndexHits::of_names(&set, 3, Some(|i: usize| Some(names[i])), read, 2).unwrap();
        assert_eq!(
            (all.names, all.patterns, all.counts),
            (vec![0, 1], vec![0, 1], vec![1, 1])
        );
        // One name the fast reader cannot read: every name through `read`.
        let partial = |i: usize| (i != 1).then(|| names[i]);
        let found = IndexHits::of_names(&set, 3, Some(partial), read, 2).unwrap();
        assert_eq!(found.names, vec![0, 1]);
        let failing = IndexHits::of_names(
            &set,
            3,
            Some(partial),
            || Err::<Vec<&str>, _>("unreadable"),
            1,
        );
        assert!(matches!(failing, Err(HitsError::Read("unreadable"))));
        let none: Option<fn(usize) -> Option<&'static str>> = None;
        assert_eq!(
            IndexHits::of_names(&set, 3, none, read, 1).unwrap().counts,
            vec![1, 1]
        );
    }

    /// Every name answered in sequence, against each name answered alone.
    fn sequence_agrees(patterns: &[&str], names: &[&str]) {
        let Ok(set) = PatternSet::new(patterns) else {
            panic!("the patterns compile")
        };
        set.with_matcher(|m| {
            let mut sequence = SequenceMatcher::default();
            for name in names {
                let (mut resumed, mut alone) = (Vec::new(), Vec::new());
                sequence.matches(name, m, &mut resumed).unwrap();
                m.match_name(name, &mut alone).unwrap();
                assert_eq!(resumed, alone, "{name:?}");
                // Boundaries sit at increasing offsets, however often a name repeats.
                let offsets: Vec<usize> = sequence.boundaries.iter().map(|b| b.0).collect();
                assert!(
                    offsets.windows(2).all(|w| w[0] < w[1]),
                    "{name:?}: {offsets:?}"
                );
            }
        });
    }

    #[test]
    fn resumes_after_shared_segments_and_after_the_whole_previous_name() {
        let patterns = [
            "layers.*.mlp",
            "layers.*.mlp.experts.*.gate_proj",
            "**.up_proj",
            "a.bc",
        ];
        sequence_agrees(
            &patterns,
            &[
                "",
                "layers",
                "layers.0",
                "layers.0.mlp",
                "layers.0.mlp.experts.7",
                "layers.0.mlp.experts.7.gate_proj",
                "layers.0.mlp.experts.7.up_proj",
                "layers.0.mlp.experts.70.gate_proj",
                "layers.1.mlp",
                "a.b",
                "a.bc",
                "a.bc",
                "a.bc",
                "a.b",
            ],
        );
    }

    #[test]
    fn runs_side_by_side_join_into_the_hits_of_one_run() {
        let Ok(set) = PatternSet::new(&["layers.*.mlp.experts.*.up_proj", "**.7", "never"]) else {
            panic!("the patterns compile")
        };
        let names: Vec<String> = (0..3 * MIN_NAMES_PER_THREAD + 5)
            .map(|i| match i % 3 {
                0 => format!("layers.{}.mlp.experts.{i}.up_proj", i / 1000),
                1 => format!("layers.{}.mlp.experts.{i}", i / 1000),
                _ => format!("a.{}", i % 10),
            })
            .collect();
        let name_at = |i: usize| Some(names[i].as_str());
        let one = IndexHits::of(&set, names.len(), name_at, 1)
            .unwrap()
            .unwrap();
        for threads in [2, 3, 64] {
            let many = IndexHits::of(&set, names.len(), name_at, threads)
                .unwrap()
                .unwrap();
            assert_eq!(many.names, one.names, "{threads} threads");
            assert_eq!(many.patterns, one.patterns, "{threads} threads");
            assert_eq!(many.counts, one.counts, "{threads} threads");
        }
        assert_eq!(one.counts[2], 0);
        assert_eq!(one.names.len(), one.patterns.len());
        assert!(one.names.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_name_that_cannot_be_read_leaves_no_hits() {
        let Ok(set) = PatternSet::new(&["a.*"]) else {
            panic!("the pattern compiles")
        };
        let unreadable = 2 * MIN_NAMES_PER_THREAD + 1;
        let name_at = |i: usize| (i != unreadable).then_some("a.b");
        for threads in [1, 2] {
            let found = IndexHits::of(&set, 3 * MIN_NAMES_PER_THREAD, name_at, threads).unwrap();
            assert!(found.is_none(), "{threads} threads");
        }
        let empty = IndexHits::of(&set, 0, name_at, 2).unwrap().unwrap();
        assert_eq!((empty.names.len(), empty.counts), (0, vec![0]));
    }

    #[test]
    fn common_prefix_counts_bytes_across_words() {
        assert_eq!(common_prefix(b"", b"abc"), 0);
        assert_eq!(
            common_prefix(b"layers.12.mlp", b"layers.12.mlp.experts"),
            13
        );
        assert_eq!(common_prefix(b"layers.12.mlp", b"layers.13.mlp"), 8);
        assert_eq!(
            common_prefix(b"abcdefghijklmnopq", b"abcdefghijklmnopz"),
            16
        );
    }
}
