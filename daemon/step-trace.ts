/**
 * Timestamps on the per-token path, for profiling only (reproduction/profile-engine.ts): where a
 * decode step's time goes between the main thread (batcher, decode loop, stage engine) and the
 * engine worker (feeds, onnxruntime, outputs); and on a request's way to its first token
 * (reproduction/profile-ttft.ts: the ingress's `i.*` marks). Off unless SHOAL_TRACE_DIR names a
 * directory; then each thread keeps its marks in memory and `dumpStepTrace` writes them there as
 * JSON. Wall-clock times (timeOrigin + now) so marks of different threads line up. When off, a
 * mark is one branch.
 */
import { writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { isMainThread, threadId } from 'node:worker_threads'

const dir = process.env.SHOAL_TRACE_DIR
const marks: Array<[string, number]> = []

export function stepMark (label: string): void {
  if (dir !== undefined) marks.push([label, performance.timeOrigin + performance.now()])
}

/** Writes this thread's marks to SHOAL_TRACE_DIR/trace-<main|worker>-<pid>-<thread>.json and clears them. */
export function dumpStepTrace (): void {
  if (dir === undefined) return
  writeFileSync(join(dir, `trace-${isMainThread ? 'main' : 'worker'}-${process.pid}-${threadId}.json`), JSON.stringify(marks))
  marks.length = 0
}
