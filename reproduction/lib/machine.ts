/** The machine lines of the result headers: these machines are shared, so every result says how busy it was. */
import { loadavg } from 'node:os'

/** Load averages (1, 5, 15 min) as `0.4 0.7 0.9`, `digits` after the point: for a snapshot taken earlier. */
export function formatLoad (load: readonly number[], digits = 1): string {
  return load.map(x => x.toFixed(digits)).join(' ')
}

/** The load averages now, as `formatLoad` writes them. */
export function loadAverage (digits = 1): string {
  return formatLoad(loadavg(), digits)
}
