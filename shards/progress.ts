/**
 * Progress lines for long work (generating the demo model, compiling a checkpoint): the first and
 * the last step always report, the steps between at most once per `everyMs`, so a 24-layer toy
 * model prints two lines and a multi-GB checkpoint one line a second, never silence.
 */
export interface ProgressOptions {
  everyMs?: number
  now?: () => number
}

export function createProgress (report: (line: string) => void, label: string, options: ProgressOptions = {}): (done: number, total: number) => void {
  const everyMs = options.everyMs ?? 1000
  const now = options.now ?? Date.now
  const started = now()
  let last: number | undefined
  return (done, total) => {
    const t = now()
    if (done >= total) {
      report(`${label}: ${total}/${total} layers, done in ${((t - started) / 1000).toFixed(1)} s`)
      return
    }
    if (last !== undefined && t - last < everyMs) return
    last = t
    report(`${label}: ${done}/${total} layers (${Math.floor((100 * done) / total)}%)`)
  }
}
