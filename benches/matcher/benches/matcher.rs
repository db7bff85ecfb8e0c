//! `PatternSet` against `globset` over about a million FQNs with 20 patterns, both sets built once.
//! globset sees the same names with `.` mapped to `/` and `literal_separator(true)`, so `*` stays
//! inside one segment as in meshbind. Criterion reports names per second (throughput); a summary
//! line at the end gives the ratio.

use std::hint::black_box;
use std::time::Instant;

use _core::matcher::PatternSet;
use criterion::{criterion_group, Criterion, Throughput};
use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// Twenty patterns of the forms plans use, none with meshbind-only syntax (globset has no ranges).
const PATTERNS: [&str; 20] = [
    "layers.*.mlp.experts.*.gate_proj",
    "layers.*.mlp.experts.*.up_proj",
    "layers.*.mlp.experts.*.down_proj",
    "layers.*.self_attn.q_proj",
    "layers.*.self_attn.k_proj",
    "layers.*.self_attn.v_proj",
    "layers.*.self_attn.o_proj",
    "layers.*.mlp.gate",
    "lm_head",
    "embed_tokens",
    "**.down_proj",
    "layers.*.mlp.shared_experts.*",
    "layers.1?.mlp.experts.*",
    "layers.*.{input,post_attention}_layernorm",
    "layers.[0-9].self_attn",
    "layers.*.mlp.experts.1*.gate_proj",
    "norm",
    "layers.**.q_proj",
    "layers.*.mlp.experts.*[05].up_proj",
    "layers.6?.mlp",
];

/// The FQNs of a 61-layer, 4096-expert MoE tree (as `moe_tree_fqns` in Python): about a million.
fn fqns() -> Vec<String> {
    let mut names = vec![String::new(), "embed_tokens".into(), "layers".into()];
    for layer in 0..61 {
        let base = format!("layers.{layer}");
        names.push(base.clone());
        for leaf in [
            "input_layernorm",
            "self_attn",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
        ] {
            names.push(format!("{base}.{leaf}"));
        }
        for leaf in ["post_attention_layernorm", "mlp", "mlp.gate", "mlp.experts"] {
            names.push(format!("{base}.{leaf}"));
        }
        for expert in 0..4096 {
            let e = format!("{base}.mlp.experts.{expert}");
            names.extend([
                format!("{e}.gate_proj"),
                format!("{e}.up_proj"),
                format!("{e}.down_proj"),
            ]);
            names.push(e);
        }
        let shared = format!("{base}.mlp.shared_experts");
        names.extend([
            format!("{shared}.gate_proj"),
            format!("{shared}.up_proj"),
            format!("{shared}.down_proj"),
        ]);
        names.push(shared);
    }
    names.extend(["norm".into(), "lm_head".into()]);
    names
}

fn globset() -> GlobSet {
    let mut builder = GlobSetBuilder::new();
    for pattern in PATTERNS {
        let glob = GlobBuilder::new(&pattern.replace('.', "/"))
            .literal_separator(true)
            .build();
        builder.add(glob.unwrap_or_else(|e| panic!("globset rejects {pattern}: {e}")));
    }
    builder
        .build()
        .unwrap_or_else(|e| panic!("globset set: {e}"))
}

fn meshbind_set() -> PatternSet {
    PatternSet::new(&PATTERNS).unwrap_or_else(|_| panic!("meshbind rejects a pattern"))
}

fn count_meshbind(set: &PatternSet, names: &[String]) -> usize {
    set.with_matcher(|m| {
        let mut out = Vec::new();
        let mut total = 0;
        for name in names {
            out.clear();
            m.match_name(name, &mut out)
                .unwrap_or_else(|e| panic!("{e}"));
            total += out.len();
        }
        total
    })
}

fn count_globset(set: &GlobSet, names: &[String]) -> usize {
    let mut out = Vec::new();
    let mut total = 0;
    for name in names {
        set.matches_into(name, &mut out);
        total += out.len();
    }
    total
}

fn matchers(c: &mut Criterion) {
    let names = fqns();
    let slashed: Vec<String> = names.iter().map(|n| n.replace('.', "/")).collect();
    let (ours, theirs) = (meshbind_set(), globset());
    assert_eq!(
        count_meshbind(&ours, &names),
        count_globset(&theirs, &slashed),
        "the two sets disagree"
    );
    let mut group = c.benchmark_group("match 1M FQNs x 20 patterns");
    group
        .throughput(Throughput::Elements(names.len() as u64))
        .sample_size(10);
    group.bench_function("meshbind PatternSet", |b| {
        b.iter(|| count_meshbind(&ours, black_box(&names)))
    });
    group.bench_function("globset GlobSet", |b| {
        b.iter(|| count_globset(&theirs, black_box(&slashed)))
    });
    group.finish();
}

/// Names per second of each, and their ratio, over the best of five runs.
fn summary() {
    let names = fqns();
    let slashed: Vec<String> = names.iter().map(|n| n.replace('.', "/")).collect();
    let (ours, theirs) = (meshbind_set(), globset());
    let best = |f: &dyn Fn() -> usize| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                black_box(f());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    };
    let ours_s = best(&|| count_meshbind(&ours, &names));
    let theirs_s = best(&|| count_globset(&theirs, &slashed));
    let rate = |s: f64| names.len() as f64 / s / 1e6;
    println!(
        "summary: {} names, 20 patterns: meshbind {:.1} M names/s, globset {:.1} M names/s, meshbind / globset throughput = {:.2}x",
        names.len(),
        rate(ours_s),
        rate(theirs_s),
        theirs_s / ours_s
    );
}

criterion_group!(benches, matchers);

fn main() {
    benches();
    summary();
    Criterion::default().configure_from_args().final_summary();
}
