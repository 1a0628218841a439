/**
 * `shoal serve`'s glibc malloc settings for a benchmark that hosts the daemon or an engine in its
 * own process: `shoal serve` gets them from its launcher, which re-executes Node with them
 * (scripts/malloc.mjs), but `node reproduction/….ts` has no launcher. Without them an engine step's
 * transient buffers land on fresh pages: a sampled 60m int4 step, whose fetched logits are a new
 * 128 KB buffer, ran 0.1–0.3 ms longer in-process than under the settings (docs/engine-notes.md,
 * wave 32).
 */
import { glibcVersion, mallocTunables } from '../../scripts/malloc.mjs'

/**
 * This process's environment with `shoal serve`'s malloc settings, chosen as its launcher chooses
 * them; undefined when there is nothing to add (already set, the operator's own malloc tunables,
 * or not glibc). For a child that hosts an engine, or for re-executing this process.
 */
export function serveMallocEnv (): NodeJS.ProcessEnv | undefined {
  const tunables = mallocTunables(['serve'], process.env.GLIBC_TUNABLES, { platform: process.platform, glibc: glibcVersion() })
  return tunables === undefined ? undefined : { ...process.env, GLIBC_TUNABLES: tunables }
}

/**
 * Re-executes this script once with `shoal serve`'s malloc settings (same PID, arguments and
 * scheduling policy); returns when they are already set, the operator set malloc tunables of their
 * own, or the platform has none (not glibc, or no process.execve): the run then says which it got.
 */
export function execWithServeMalloc (): void {
  const env = serveMallocEnv()
  if (env === undefined || typeof process.execve !== 'function') return
  process.execve(process.execPath, [process.execPath, ...process.execArgv, ...process.argv.slice(1)], env)
}

/** The malloc settings this process runs with, for a benchmark's header. */
export function mallocSettings (): string {
  const current = process.env.GLIBC_TUNABLES
  return current !== undefined && current.includes('glibc.malloc.') ? `GLIBC_TUNABLES=${current}` : "glibc's defaults"
}
