/** The machine lines of the result headers: these machines are shared, so every result says how busy it was. */
import { spawnSync } from 'node:child_process'
import { loadavg } from 'node:os'

/** Load averages (1, 5, 15 min) as `0.4 0.7 0.9`, `digits` after the point: for a snapshot taken earlier. */
export function formatLoad (load: readonly number[], digits = 1): string {
  return load.map(x => x.toFixed(digits)).join(' ')
}

/** The load averages now, as `formatLoad` writes them. */
export function loadAverage (digits = 1): string {
  return formatLoad(loadavg(), digits)
}

/** The CPU's model name as lscpu reports it ('unknown CPU' without lscpu). */
export function lscpuModel (): string {
  const r = spawnSync('lscpu', [], { encoding: 'utf8' })
  return /Model name:\s*(.+)/.exec(r.stdout ?? '')?.[1]?.trim() ?? 'unknown CPU'
}

/** `<short hash> <subject>` of the checkout at `dir` (cut to 100 characters), `?` where git cannot tell: which code a result measured. */
export function gitDescribe (dir: string): string {
  const r = spawnSync('git', ['-C', dir, 'log', '-1', '--format=%h %s'], { encoding: 'utf8' })
  return r.status === 0 ? r.stdout.trim().slice(0, 100) : '?'
}
