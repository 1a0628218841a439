/**
 * Realtime scheduling for benchmark children. Under a realtime policy (`chrt -r N node ...`, which
 * keeps other users' work on a shared machine from preempting the measurement), servers and
 * llama-bench run one priority below this process: a server's threads at the client's own priority
 * could hold both cores for a whole RR quantum while the client waits to read a chunk.
 */
import { spawn, spawnSync } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'

/** This process's policy as `chrt -p` words it, for a result's header; `?` without chrt. */
export function schedulingPolicy (): string {
  return spawnSync('chrt', ['-p', String(process.pid)], { encoding: 'utf8' }).stdout?.trim().replace(/\n/g, '; ') ?? '?'
}

let prefix: string[] | undefined

/**
 * `chrt -r|-f PRIO-1` when this process is SCHED_RR or SCHED_FIFO at priority 2 or more, else
 * nothing. Asked once: the policy does not change under a run, and chrt is a process to spawn.
 */
export function rtPrefix (): string[] {
  if (prefix !== undefined) return prefix
  const out = spawnSync('chrt', ['-p', String(process.pid)], { encoding: 'utf8' }).stdout ?? ''
  const policy = /policy: (SCHED_\w+)/.exec(out)?.[1]
  const prio = Number(/priority: (\d+)/.exec(out)?.[1] ?? 0)
  prefix = (policy !== 'SCHED_RR' && policy !== 'SCHED_FIFO') || prio < 2 ? [] : ['chrt', policy === 'SCHED_RR' ? '-r' : '-f', String(prio - 1)]
  return prefix
}

/** `cmd argv` behind `rtPrefix()`, as a command and its arguments for spawn or spawnSync. */
export function underRt (cmd: string, argv: string[]): [string, string[]] {
  const rt = rtPrefix()
  return rt.length === 0 ? [cmd, argv] : [rt[0]!, [...rt.slice(1), cmd, ...argv]]
}

/** spawn(), under RT when this process is realtime (chrt execs: the pid is the program's, so /proc/PID reads the server). */
export function spawnRt (cmd: string, argv: string[], options: Parameters<typeof spawn>[2]): ChildProcess {
  const [c, a] = underRt(cmd, argv)
  return spawn(c, a, options)
}
