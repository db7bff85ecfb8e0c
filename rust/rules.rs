//! The rules both sides of the boundary decide, each written once: the checks here call them,
//! and Python calls them through `meshbind._core` (`split_dim`, `not_divisible`).

/// The dimension `Shard(dim)` splits in a tensor of rank `rank`, counted from 0 as torch counts
/// it (`Shard(-1)` of a matrix is dimension 1); `None` when the tensor has no such dimension.
pub fn split_dim(dim: i64, rank: i64) -> Option<i64> {
    (-rank <= dim && dim < rank).then(|| dim.rem_euclid(rank))
}

/// Why `count` (what the message calls `what`: `num_experts`, `num_attention_heads`) cannot be
/// split evenly over the `size` ranks of `axis`, or `None` when it can.
pub fn not_divisible(what: &str, count: i64, axis: &str, size: i64) -> Option<String> {
    (size < 1 || count % size != 0)
        .then(|| format!("{what} {count} is not divisible by the '{axis}' axis size {size}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_negative_dim_counts_from_the_end_and_one_beyond_the_rank_is_none() {
        assert_eq!(split_dim(-1, 2), Some(1));
        assert_eq!(split_dim(-2, 2), Some(0));
        assert_eq!(split_dim(1, 2), Some(1));
        assert_eq!(split_dim(2, 2), None);
        assert_eq!(split_dim(-3, 2), None);
        assert_eq!(split_dim(0, 0), None);
    }

    #[test]
    fn an_indivisible_count_is_named_with_its_axis() {
        assert_eq!(not_divisible("num_experts", 8, "ep", 4), None);
        assert_eq!(
            not_divisible("num_experts", 8, "ep", 3).as_deref(),
            Some("num_experts 8 is not divisible by the 'ep' axis size 3")
        );
        assert!(not_divisible("heads", 8, "tp", 0).is_some());
    }
}
