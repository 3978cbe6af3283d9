//! The loss curve as a small self-contained SVG (train loss and eval loss against steps).

use std::fmt::Write;

pub fn svg(train: &[(f64, f64)], eval: &[(f64, f64)]) -> String {
    let (w, h, pad) = (640.0, 360.0, 48.0);
    let all = train.iter().chain(eval).filter(|p| p.1.is_finite());
    let (mut x1, mut y0, mut y1) = (1f64, f64::INFINITY, f64::NEG_INFINITY);
    for (x, y) in all {
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    if y1 - y0 < 1e-9 {
        y1 = y0 + 1.0;
    }
    let sx = |x: f64| pad + x / x1 * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let line = |pts: &[(f64, f64)]| {
        pts.iter()
            .filter(|p| p.1.is_finite())
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<line x1="{pad}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{b}" stroke="black"/>
<text x="{pad}" y="{ty}">loss</text><text x="{r}" y="{lx}" text-anchor="end">step {x1}</text>
<text x="4" y="{top}">{y1:.3}</text><text x="4" y="{b}">{y0:.3}</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{tl}"/>
<polyline fill="none" stroke="#d62728" stroke-width="2" points="{el}"/>
<text x="{lgx}" y="{pad}" fill="#1f77b4">train</text><text x="{lgx}" y="{lg2}" fill="#d62728">eval</text>
</svg>
"##,
        b = h - pad,
        r = w - pad,
        ty = pad - 12.0,
        lx = h - pad + 20.0,
        top = pad + 4.0,
        tl = line(train),
        el = line(eval),
        lgx = w - pad - 60.0,
        lg2 = pad + 16.0,
    );
    s
}
