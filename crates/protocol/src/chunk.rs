//! Splitting a list into messages that fit the bus's payload limit.

/// Splits `items` into chunks, in order, whose sizes (each item's as `size` gives it, e.g.
/// its [`crate::encoded_len`] or an upper bound of it) add up to at most `budget`. Chunks
/// are filled greedily, so no chunk could take the next chunk's first item. No chunk is
/// empty (an empty input gives no chunk); an item larger than `budget` goes alone.
///
/// `budget` is for the items only: leave room in it for the fields of the message that
/// carries a chunk.
pub fn chunk_by_budget<T>(
    items: Vec<T>,
    budget: usize,
    mut size: impl FnMut(&T) -> usize,
) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut used = 0usize;
    for item in items {
        let n = size(&item);
        if !cur.is_empty() && used.saturating_add(n) > budget {
            out.push(std::mem::take(&mut cur));
            used = 0;
        }
        used = used.saturating_add(n);
        cur.push(item);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encoded_len;
    use proptest::prelude::*;

    fn len(s: &String) -> usize {
        encoded_len(s).unwrap()
    }

    proptest! {
        #[test]
        fn chunks_keep_order_respect_the_budget_and_are_greedy(
            items in prop::collection::vec("[a-z]{0,40}", 0..60),
            budget in 0usize..200,
        ) {
            let chunks = chunk_by_budget(items.clone(), budget, len);
            prop_assert_eq!(chunks.concat(), items.clone());
            prop_assert_eq!(chunks.is_empty(), items.is_empty());
            for (i, c) in chunks.iter().enumerate() {
                prop_assert!(!c.is_empty());
                let total: usize = c.iter().map(len).sum();
                // Over budget only as a lone oversized item.
                prop_assert!(total <= budget || c.len() == 1, "{} > {}", total, budget);
                if let Some(next) = chunks.get(i + 1) {
                    prop_assert!(total + len(&next[0]) > budget, "chunk {} could take more", i);
                }
                // The sizes are exact: the chunk's items encode in `total` bytes plus the
                // vector's 8-byte length.
                prop_assert_eq!(encoded_len(c).unwrap(), total + 8);
            }
        }
    }

    #[test]
    fn an_oversized_item_goes_alone() {
        let chunks = chunk_by_budget(vec![1usize, 1, 10, 1, 1], 3, |&n| n);
        assert_eq!(chunks, vec![vec![1, 1], vec![10], vec![1, 1]]);
        assert!(chunk_by_budget(Vec::<usize>::new(), 3, |&n| n).is_empty());
        assert_eq!(
            chunk_by_budget(vec![0usize; 5], 0, |&n| n),
            vec![vec![0; 5]]
        );
    }
}
