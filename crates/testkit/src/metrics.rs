//! Prometheus text exposition, read as tests and the chaos bench read it.

/// The sum of every series of metric `name` in a Prometheus text page (0 when absent):
/// `name{...} v` and `name v`, not `name_suffix`.
pub fn metric_sum_in(page: &str, name: &str) -> f64 {
    metric_where_in(page, name, &[])
}

/// [`metric_sum_in`] over the series whose labels include every `key="value"` of `labels`.
pub fn metric_where_in(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                (rest.starts_with('{') || rest.starts_with(' '))
                    && labels.iter().all(|(k, v)| {
                        let set = rest.split('}').next().unwrap_or("");
                        set.contains(&format!("{k}=\"{v}\""))
                    })
            })
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::{metric_sum_in, metric_where_in};

    #[test]
    fn sums_every_series_of_the_name_only() {
        let page = "# HELP x_total x\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 3.5\nx_total_more 100\nx 7\ny_x_total 9\n";
        assert_eq!(metric_sum_in(page, "x_total"), 5.5);
        assert_eq!(metric_sum_in(page, "x"), 7.0);
        assert_eq!(metric_sum_in(page, "absent"), 0.0);
        assert_eq!(metric_where_in(page, "x_total", &[("a", "2")]), 3.5);
        assert_eq!(metric_where_in(page, "x_total", &[("a", "3")]), 0.0);
        assert_eq!(
            metric_where_in(page, "x", &[("a", "1")]),
            0.0,
            "x has no labels"
        );
    }
}
