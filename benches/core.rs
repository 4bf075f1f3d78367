// placeholder until the criterion benchmarks land
fn main() {}
