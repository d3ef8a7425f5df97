//! The end-of-run picture: loss per step (left axis) and step wall time (right axis), SVG.

use crate::execute::StepMetrics;
use anyhow::anyhow;
use plotters::prelude::*;

/// An SVG of the loss curve above the step-time curve.
pub fn training_svg(lines: &[StepMetrics]) -> Result<String, anyhow::Error> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
        let (top, bottom) = root.split_vertically(330);
        let n = lines.len().max(2) as u32;
        let range = |v: &mut dyn Iterator<Item = f64>| {
            let (mut lo, mut hi) = (f64::MAX, f64::MIN);
            for x in v.filter(|x| x.is_finite()) {
                lo = lo.min(x);
                hi = hi.max(x);
            }
            if lo > hi {
                (0.0, 1.0)
            } else {
                let pad = ((hi - lo) * 0.05).max(1e-6);
                (lo - pad, hi + pad)
            }
        };
        for (area, what, color, get) in [
            (
                &top,
                "loss",
                BLUE,
                (|m: &StepMetrics| m.loss) as fn(&StepMetrics) -> f64,
            ),
            (&bottom, "step time (s)", RED, |m: &StepMetrics| {
                m.step_time_s
            }),
        ] {
            let (lo, hi) = range(&mut lines.iter().map(get));
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{what} per step"), ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(35)
                .y_label_area_size(60)
                .build_cartesian_2d(1u32..n, lo..hi)
                .map_err(|e| anyhow!("plot: {e}"))?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc(what)
                .draw()
                .map_err(|e| anyhow!("plot: {e}"))?;
            chart
                .draw_series(LineSeries::new(
                    lines.iter().map(|m| (m.step, get(m))),
                    color.stroke_width(2),
                ))
                .map_err(|e| anyhow!("plot: {e}"))?;
        }
        root.present().map_err(|e| anyhow!("plot: {e}"))?;
    }
    Ok(svg)
}
