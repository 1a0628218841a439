/**
 * What the kernels' bit checks share (head-check.ts, f32-check.ts): a graph of a kernel's op beside
 * onnxruntime's own, built, loaded on a session worker (off-thread-sessions.ts, never the caller's
 * event loop) with the library, asked, and removed; the answer memoized per check and library, a
 * failure to ask counted as a no. And the comparison itself, bit for bit.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createOffThreadSessions, type OffThreadSession } from '../off-thread-sessions.ts'
import { GraphBuilder } from '../../../shards/graph/builder.ts'
import { loadKernelLibrary } from './load.ts'

const memo = new Map<string, Promise<boolean>>()

/** A fixed pseudo-random sequence in [−0.5, 0.5) (Math.imul: a double product would lose the low bits). */
export function checkRandom (seed: number): () => number {
  let s = seed
  return () => { s = (Math.imul(s, 1103515245) + 12345) >>> 0; return (s >>> 8) / 16777216 - 0.5 }
}

/**
 * `name`'s answer for `lib`: the graph `build` writes, on two intra-op threads (as engines run, the
 * products' columns shared between them), asked by `ask`. Once a process per name and library.
 */
export async function askKernelGraph (name: string, lib: string, build: (g: GraphBuilder) => void, ask: (session: OffThreadSession) => Promise<boolean>): Promise<boolean> {
  const key = `${name}\n${lib}`
  let p = memo.get(key)
  if (p === undefined) memo.set(key, p = askOnce(name, lib, build, ask).catch(() => false))
  return await p
}

async function askOnce (name: string, lib: string, build: (g: GraphBuilder) => void, ask: (session: OffThreadSession) => Promise<boolean>): Promise<boolean> {
  loadKernelLibrary(lib)
  const dir = await mkdtemp(join(tmpdir(), `shoal-${name}-`))
  const host = createOffThreadSessions()
  try {
    const g = new GraphBuilder('check.onnx.data')
    build(g)
    await writeFile(join(dir, 'check.onnx'), g.encode(name, `shoal ${name}`))
    await writeFile(join(dir, 'check.onnx.data'), Buffer.concat(g.data()))
    return await ask(await host.create(join(dir, 'check.onnx'), { threads: 2, kernels: lib }))
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}

/** Whether two outputs hold the same floats bit for bit. */
export function sameBits (a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length)
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length)
  return x.every((v, i) => v === y[i])
}
