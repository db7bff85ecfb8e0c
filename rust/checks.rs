//! The bulk arithmetic of plan validation (the `layout` checks and the expert rule), over flat arrays
//! covering every planned module at once.
//!
//! Python flattens each module's named placements into rows; this checks them all in one pass
//! and returns the problems. Nothing here knows about torch: a placement is a kind and a dim.
//! A row's "module" may stand for many modules whose rows are the same (Python checks such a
//! unit once and gives its problems to each of them).

use crate::rules::{not_divisible, split_dim};

/// What a placement row is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PlacementKind {
    Shard,
    Replicate,
    Partial,
}

/// One named placement: `module`'s `label` (a parameter path or `in_src`…) on `axis`.
pub struct PlacementRow {
    pub module: u32,
    pub label: u32,
    pub axis: u32,
    pub kind: PlacementKind,
    /// The `d` of `Shard(d)` (unused for other kinds).
    pub dim: i64,
    /// The parameter's rank and `shape[0]`, when the row is a parameter whose shape is known.
    pub rank: Option<i64>,
    pub first_dim: Option<i64>,
    /// For a `Shard(d)` of a parameter whose shape is known, the size of dimension `d`.
    pub dim_size: Option<i64>,
    /// Whether the row places a parameter (rule 5 looks only at parameters).
    pub is_param: bool,
}

/// The layout every row is checked against: axis names and their sizes (`None`: not in the context).
pub struct AxisTable<'a> {
    pub names: &'a [String],
    pub sizes: &'a [Option<i64>],
    /// The index of the `ep` axis among `names`, if any row or module mentions it.
    pub ep: Option<u32>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ProblemCode {
    Layout,
    Expert,
}

impl ProblemCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemCode::Layout => "layout",
            ProblemCode::Expert => "expert",
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Problem {
    pub module: u32,
    pub code: ProblemCode,
    pub message: String,
}

/// Checks every row, and every `ep` module (`num_experts[m]` is `Some` for those, at least 1; every
/// axis size is positive), returning every `layout` problem and the first `expert` problem of each
/// module. Rows may come in any order; every row's module must be below `num_experts.len()`.
pub fn check_placements(
    axes: &AxisTable<'_>,
    labels: &[String],
    rows: &[PlacementRow],
    num_experts: &[Option<i64>],
) -> Vec<Problem> {
    let mut problems = Vec::new();
    let label = |row: &PlacementRow| {
        labels
            .get(row.label as usize)
            .map(String::as_str)
            .unwrap_or("?")
    };
    let axis_name = |axis: u32| {
        axes.names
            .get(axis as usize)
            .map(String::as_str)
            .unwrap_or("?")
    };
    let known_axes = || {
        let mut known: Vec<&str> = axes
            .names
            .iter()
            .zip(axes.sizes)
            .filter(|(_, s)| s.is_some())
            .map(|(n, _)| n.as_str())
            .collect();
        known.sort_unstable();
        if known.is_empty() {
            "none".to_owned()
        } else {
            known.join(", ")
        }
    };
    for row in rows {
        if axes
            .sizes
            .get(row.axis as usize)
            .copied()
            .flatten()
            .is_none()
        {
            problems.push(Problem {
                module: row.module,
                code: ProblemCode::Layout,
                message: format!(
                    "{} is placed on axis '{}', which the layout context lacks (axes: {})",
                    label(row),
                    axis_name(row.axis),
                    known_axes()
                ),
            });
        }
        if let (PlacementKind::Shard, Some(rank)) = (row.kind, row.rank) {
            if row.dim >= rank || row.dim < -rank {
                problems.push(Problem {
                    module: row.module,
                    code: ProblemCode::Layout,
                    message: format!(
                        "{} is Shard({}) on axis '{}', beyond the parameter's rank {rank}",
                        label(row),
                        row.dim,
                        axis_name(row.axis)
                    ),
                });
            }
        }
    }
    for row in rows {
        if row.is_param && row.kind == PlacementKind::Partial {
            problems.push(Problem {
                module: row.module,
                code: ProblemCode::Layout,
                message: format!(
                    "{} is Partial on axis '{}': a parameter holds values, not a pending sum (Shard or Replicate it)",
                    label(row),
                    axis_name(row.axis)
                ),
            });
        }
    }
    problems.extend(indivisible_shards(axes, rows, &label, &axis_name));
    // Rows come in any order; rule 5 needs each module's rows together.
    let mut order: Vec<&PlacementRow> = rows.iter().collect();
    order.sort_by_key(|row| row.module);
    let mut start = 0;
    for (module, experts) in num_experts.iter().enumerate() {
        let module = module as u32;
        let end = start
            + order[start..]
                .iter()
                .take_while(|r| r.module == module)
                .count();
        if let Some(experts) = *experts {
            if let Some(message) = expert_problem(axes, &order[start..end], experts, &label) {
                problems.push(Problem {
                    module,
                    code: ProblemCode::Expert,
                    message,
                });
            }
        }
        start = end;
    }
    problems
}

/// Balanced layouts: the size of each dimension a parameter is `Shard` on must be
/// divisible by the product of the sizes of every axis sharding that dimension.
/// A parameter's dimension: `(unit, label, dimension)`.
type ShardedDim = (u32, u32, i64);

fn indivisible_shards<'r>(
    axes: &AxisTable<'_>,
    rows: &'r [PlacementRow],
    label: &dyn Fn(&'r PlacementRow) -> &'r str,
    axis_name: &dyn Fn(u32) -> &'r str,
) -> Vec<Problem> {
    // (module, label, dimension) → the rows sharding it, in row order.
    let mut sharding: Vec<(ShardedDim, Vec<&'r PlacementRow>)> = Vec::new();
    let mut seen: rustc_hash::FxHashMap<ShardedDim, usize> = rustc_hash::FxHashMap::default();
    for row in rows {
        let (PlacementKind::Shard, true, Some(rank), Some(_)) =
            (row.kind, row.is_param, row.rank, row.dim_size)
        else {
            continue;
        };
        let Some(dim) = split_dim(row.dim, rank) else {
            continue; // beyond the rank: reported on its own
        };
        let key = (row.module, row.label, dim);
        let slot = *seen.entry(key).or_insert_with(|| {
            sharding.push((key, Vec::new()));
            sharding.len() - 1
        });
        sharding[slot].1.push(row);
    }
    let mut problems = Vec::new();
    for ((module, _, dim), group) in sharding {
        let sizes: Option<Vec<i64>> = group
            .iter()
            .map(|row| axes.sizes.get(row.axis as usize).copied().flatten())
            .collect();
        // An axis the context lacks is reported on its own.
        let Some(sizes) = sizes else { continue };
        let product = sizes
            .iter()
            .try_fold(1i64, |acc, &size| acc.checked_mul(size));
        let Some(size) = group[0].dim_size else {
            continue;
        };
        if product.is_some_and(|product| size % product == 0) {
            continue;
        }
        let named: Vec<String> = group
            .iter()
            .zip(&sizes)
            .map(|(row, size)| format!("'{}'={size}", axis_name(row.axis)))
            .collect();
        let product = product.map_or_else(|| "over 2**63".to_owned(), |p| p.to_string());
        problems.push(Problem {
            module,
            code: ProblemCode::Layout,
            message: format!(
                "{} dimension {dim} of size {size} is not divisible by {product}, the product of the sizes of the axes sharding it ({}): shards would be uneven",
                label(group[0]),
                named.join(", ")
            ),
        });
    }
    problems
}

/// The expert rule for one `ep` module, given its rows.
fn expert_problem<'r>(
    axes: &AxisTable<'_>,
    rows: &[&'r PlacementRow],
    num_experts: i64,
    label: &dyn Fn(&'r PlacementRow) -> &'r str,
) -> Option<String> {
    let ep_size = axes
        .ep
        .and_then(|ep| axes.sizes.get(ep as usize).copied().flatten());
    let Some(ep_size) = ep_size else {
        return Some("the layout context has no 'ep' axis, which an 'ep' module needs".to_owned());
    };
    if let Some(problem) = not_divisible("num_experts", num_experts, "ep", ep_size) {
        return Some(problem);
    }
    let mut owned = rows
        .iter()
        .copied()
        .filter(|r| r.is_param && Some(r.axis) == axes.ep && r.kind == PlacementKind::Shard)
        .peekable();
    if owned.peek().is_none() {
        return Some(
            "no parameter is Shard on the 'ep' axis: the experts would not be owned by any rank"
                .to_owned(),
        );
    }
    for row in owned {
        // Shard(-k) is Shard(rank - k), as torch reads it; without a known rank it stays unproven.
        let dim = row
            .rank
            .and_then(|rank| split_dim(row.dim, rank))
            .unwrap_or(row.dim);
        if dim != 0 {
            return Some(format!(
                "{} is Shard({}) on 'ep'; expert ownership must be Shard(0) over the expert dimension",
                label(row),
                row.dim
            ));
        }
        if row.rank.is_some() && row.first_dim != Some(num_experts) {
            let first = row
                .first_dim
                .map(|d| d.to_string())
                .unwrap_or_else(|| "none (a scalar)".to_owned());
            return Some(format!(
                "{} is Shard(0) on 'ep' but its shape[0] is {first}, not num_experts {num_experts}",
                label(row)
            ));
        }
    }
    None
}

/// The rows of `check_placements` as one table, filled in by interning axes and labels: what
/// Python hands over (see `PlacementTable` in `python/table.rs`).
#[derive(Default)]
pub struct PlacementTable {
    /// The axis that splits the experts, as the caller's world names it (`ep`).
    expert_axis: String,
    axis_names: Vec<String>,
    axis_sizes: Vec<Option<i64>>,
    labels: Vec<String>,
    label_is_param: Vec<bool>,
    rows: Vec<PlacementRow>,
    num_experts: Vec<Option<i64>>,
}

/// A row that names a unit, label or axis the table does not have, or an axis size below 1.
#[derive(Debug, PartialEq, Eq)]
pub struct TableError(pub String);

impl PlacementTable {
    /// A table over the context's axes (each size at least 1), `expert_axis` the one that splits
    /// the experts.
    pub fn new(axes: &[(String, i64)], expert_axis: &str) -> Result<Self, TableError> {
        let mut table = PlacementTable {
            expert_axis: expert_axis.to_owned(),
            ..PlacementTable::default()
        };
        for (name, size) in axes {
            if *size < 1 {
                return Err(TableError(format!(
                    "axis size {size} of {name:?} must be positive"
                )));
            }
            table.axis_names.push(name.clone());
            table.axis_sizes.push(Some(*size));
        }
        Ok(table)
    }

    /// The id of axis `name`, added (with no size: the context lacks it) when new.
    pub fn axis(&mut self, name: &str) -> u32 {
        if let Some(id) = self.axis_names.iter().position(|n| n == name) {
            return id as u32;
        }
        self.axis_names.push(name.to_owned());
        self.axis_sizes.push(None);
        (self.axis_names.len() - 1) as u32
    }

    /// The id of label `text` (`params['w']`, `in_src`…), added when new.
    pub fn label(&mut self, text: &str, is_param: bool) -> u32 {
        if let Some(id) = self.labels.iter().position(|l| l == text) {
            return id as u32;
        }
        self.labels.push(text.to_owned());
        self.label_is_param.push(is_param);
        (self.labels.len() - 1) as u32
    }

    /// A new unit (modules checked as one), with its `num_experts` when it is an `ep` unit.
    pub fn unit(&mut self, num_experts: Option<i64>) -> Result<u32, TableError> {
        if let Some(n) = num_experts.filter(|&n| n < 1) {
            return Err(TableError(format!("num_experts {n} must be at least 1")));
        }
        self.num_experts.push(num_experts);
        Ok((self.num_experts.len() - 1) as u32)
    }

    /// Adds one placement row; its unit, label and axis must be the table's.
    pub fn row(&mut self, row: PlacementRow) -> Result<(), TableError> {
        if row.module as usize >= self.num_experts.len() {
            return Err(TableError(format!("no unit {}", row.module)));
        }
        let Some(&is_param) = self.label_is_param.get(row.label as usize) else {
            return Err(TableError(format!("no label {}", row.label)));
        };
        if row.axis as usize >= self.axis_names.len() {
            return Err(TableError(format!("no axis {}", row.axis)));
        }
        self.rows.push(PlacementRow { is_param, ..row });
        Ok(())
    }

    /// Every problem of every unit (see `check_placements`).
    pub fn check(&self) -> Vec<Problem> {
        let axes = AxisTable {
            names: &self.axis_names,
            sizes: &self.axis_sizes,
            ep: self
                .axis_names
                .iter()
                .position(|n| *n == self.expert_axis)
                .map(|p| p as u32),
        };
        check_placements(&axes, &self.labels, &self.rows, &self.num_experts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        module: u32,
        axis: u32,
        kind: PlacementKind,
        dim: i64,
        shape: Option<Vec<i64>>,
    ) -> PlacementRow {
        let rank = shape.as_ref().map(|s| s.len() as i64);
        let first_dim = shape.as_ref().and_then(|s| s.first().copied());
        let dim_size = shape.as_ref().and_then(|s| {
            let d = if dim < 0 { dim + s.len() as i64 } else { dim };
            usize::try_from(d).ok().and_then(|d| s.get(d).copied())
        });
        PlacementRow {
            module,
            label: 0,
            axis,
            kind,
            dim,
            rank,
            first_dim,
            dim_size,
            is_param: true,
        }
    }

    fn check(
        sizes: &[Option<i64>],
        rows: &[PlacementRow],
        experts: &[Option<i64>],
    ) -> Vec<Problem> {
        let names = vec!["ep".to_owned(), "tp".to_owned()];
        let axes = AxisTable {
            names: &names,
            sizes,
            ep: Some(0),
        };
        check_placements(&axes, &["params['w']".to_owned()], rows, experts)
    }

    #[test]
    fn balanced_expert_ownership_passes() {
        let rows = [row(0, 0, PlacementKind::Shard, 0, Some(vec![8, 4]))];
        assert!(check(&[Some(4), Some(1)], &rows, &[Some(8)]).is_empty());
    }

    #[test]
    fn a_negative_dim_counts_from_the_end() {
        let last_but_one = [row(0, 0, PlacementKind::Shard, -2, Some(vec![8, 4]))];
        assert!(check(&[Some(4), Some(1)], &last_but_one, &[Some(8)]).is_empty());
        let last = [row(0, 0, PlacementKind::Shard, -1, Some(vec![4, 8]))];
        let problems = check(&[Some(4), Some(1)], &last, &[Some(8)]);
        assert!(problems[0]
            .message
            .contains("Shard(-1) on 'ep'; expert ownership must be Shard(0)"));
    }

    #[test]
    fn each_rule_five_failure_is_reported() {
        let shard0 = || vec![row(0, 0, PlacementKind::Shard, 0, Some(vec![8, 4]))];
        let first = |p: Vec<Problem>| p.into_iter().next().map(|p| p.message).unwrap_or_default();
        assert!(first(check(&[Some(3), Some(1)], &shard0(), &[Some(8)])).contains("not divisible"));
        assert!(first(check(&[None, Some(1)], &shard0(), &[Some(8)])).contains("lacks"));
        let replicate = [row(0, 0, PlacementKind::Replicate, 0, Some(vec![8, 4]))];
        assert!(first(check(&[Some(4), Some(1)], &replicate, &[Some(8)]))
            .contains("no parameter is Shard"));
        let shard1 = [row(0, 0, PlacementKind::Shard, 1, Some(vec![8, 8]))];
        assert!(first(check(&[Some(4), Some(1)], &shard1, &[Some(8)])).contains("must be Shard(0)"));
        let unknown_rank = [row(0, 0, PlacementKind::Shard, -2, None)];
        assert!(first(check(&[Some(4), Some(1)], &unknown_rank, &[Some(8)])).contains("Shard(-2)"));
        let short = [row(0, 0, PlacementKind::Shard, 0, Some(vec![4, 8]))];
        assert!(first(check(&[Some(4), Some(1)], &short, &[Some(8)])).contains("shape[0] is 4"));
    }

    #[test]
    fn layout_rows_are_checked_for_every_module() {
        let rows = [
            row(0, 1, PlacementKind::Shard, 2, Some(vec![8, 4])),
            row(1, 1, PlacementKind::Shard, -3, Some(vec![8, 4])),
            row(1, 1, PlacementKind::Shard, -2, Some(vec![8, 4])),
            row(2, 1, PlacementKind::Partial, 0, None),
        ];
        let problems = check(&[Some(2), None], &rows, &[None, None, None]);
        let beyond: Vec<u32> = problems
            .iter()
            .filter(|p| p.message.contains("beyond"))
            .map(|p| p.module)
            .collect();
        assert_eq!(beyond, vec![0, 1]);
        assert_eq!(
            problems
                .iter()
                .filter(|p| p.message.contains("lacks"))
                .count(),
            4
        );
    }

    #[test]
    fn the_table_interns_axes_and_labels_and_refuses_rows_it_cannot_place() {
        let mut table = PlacementTable::new(&[("ep".to_owned(), 2)], "ep").unwrap();
        assert_eq!(table.axis("ep"), 0);
        assert_eq!(table.axis("xx"), 1);
        let label = table.label("params['w']", true);
        assert_eq!(table.label("params['w']", true), label);
        let unit = table.unit(Some(3)).unwrap();
        let row = |axis| PlacementRow {
            module: unit,
            label,
            axis,
            kind: PlacementKind::Shard,
            dim: 0,
            rank: Some(2),
            first_dim: Some(3),
            dim_size: Some(3),
            is_param: false,
        };
        table.row(row(0)).unwrap();
        table.row(row(1)).unwrap();
        assert!(table.row(row(7)).is_err());
        assert!(table.unit(Some(0)).is_err());
        let codes: Vec<_> = table.check().iter().map(|p| p.code).collect();
        assert_eq!(codes, vec![ProblemCode::Layout, ProblemCode::Expert]);
        assert!(PlacementTable::new(&[("tp".to_owned(), 0)], "ep").is_err());
    }

    #[test]
    fn a_partial_parameter_and_uneven_shards_are_layout_problems() {
        let first = |p: Vec<Problem>| p.into_iter().next().map(|p| p.message).unwrap_or_default();
        let partial = [row(0, 1, PlacementKind::Partial, 0, Some(vec![8, 6]))];
        assert!(first(check(&[Some(4), Some(2)], &partial, &[None]))
            .contains("is Partial on axis 'tp'"));
        // Dimension 1 of size 6 sharded by ep=4 and tp=2 (8 does not divide 6); dimension 0 fine.
        let both = [
            row(0, 0, PlacementKind::Shard, 1, Some(vec![8, 6])),
            row(0, 1, PlacementKind::Shard, -1, Some(vec![8, 6])),
        ];
        let message = first(check(&[Some(4), Some(2)], &both, &[None]));
        assert!(
            message.contains("dimension 1 of size 6 is not divisible by 8"),
            "{message}"
        );
        assert!(message.contains("'ep'=4, 'tp'=2"), "{message}");
        let even = [row(0, 1, PlacementKind::Shard, 0, Some(vec![8, 6]))];
        assert!(check(&[Some(4), Some(2)], &even, &[None]).is_empty());
    }
}
