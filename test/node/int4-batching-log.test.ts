/**
 * An operator serving an int4 model learns from the daemon which kernel runs its products and
 * whether batching keeps every sequence's batch-of-one bits on this CPU: the 'model loaded' line
 * carries `int4Kernel` and `int4Batching` — 'bit-exact' on shoal's kernel (where the machine builds
 * it: its integer sums), and on onnxruntime's (`kernels: 'onnxruntime'`) 'bit-exact' or 'exact to
 * rounding', with one warning saying why, as the kernel probe finds it on this machine. An fp32
 * model's line carries nothing of the kind (fp32 batching is bit-exact everywhere).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { matMulNBitsRowInvariance } from '../../daemon/engine/index.ts'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { startDaemon } from '../e2e/daemon.ts'

let root: string
/** Each daemon's log lines: the default kernels, then onnxruntime's. */
const lines = { auto: [] as Array<Record<string, unknown>>, onnxruntime: [] as Array<Record<string, unknown>> }
const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-int4-log-'))
  const ckpt = join(root, 'ckpt')
  await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 6 })
  await compileShards({ modelDir: ckpt, outDir: join(root, 'int4'), modelId: 'tiny-int4', quant: 'int4' })
  await compileShards({ modelDir: ckpt, outDir: join(root, 'fp32'), modelId: 'tiny-fp32' })
  for (const kernels of ['auto', 'onnxruntime'] as const) {
    const logger = pino({ level: 'info' }, { write: (s: string) => { lines[kernels].push(JSON.parse(s) as Record<string, unknown>) } })
    const daemon = await startDaemon(join(root, 'int4'), join(root, kernels), { models: [{ dir: join(root, 'int4') }, { dir: join(root, 'fp32') }], kernels }, logger)
    await daemon.stop()
  }
}, 120_000)

afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('the daemon says which int4 kernel runs and whether int4 batching is bit-exact on this CPU', () => {
  const loaded = (of: Array<Record<string, unknown>>, model: string): Record<string, unknown> | undefined => of.find(l => l.msg === 'model loaded' && l.model === model)

  it("on onnxruntime's kernel, puts the kernel probe's verdict on the int4 model's 'model loaded' line, and nothing on the fp32 one's", async () => {
    const rows = await matMulNBitsRowInvariance(4, 32)
    expect(loaded(lines.onnxruntime, 'tiny-int4')?.int4Kernel).toBe('onnxruntime')
    expect(loaded(lines.onnxruntime, 'tiny-int4')?.int4Batching).toBe(rows.rowInvariant ? 'bit-exact' : 'exact to rounding')
    expect(loaded(lines.onnxruntime, 'tiny-fp32')).toBeDefined()
    expect(loaded(lines.onnxruntime, 'tiny-fp32')).not.toHaveProperty('int4Batching')
    expect(loaded(lines.onnxruntime, 'tiny-fp32')).not.toHaveProperty('int4Kernel')
    // Both lines say which one-position attention their shards were compiled with.
    expect(loaded(lines.onnxruntime, 'tiny-int4')?.decodeAttention).toBe('per-head')
    const warnings = lines.onnxruntime.filter(l => typeof l.msg === 'string' && l.msg.includes('exact to rounding, not to the bit'))
    expect(warnings).toHaveLength(rows.rowInvariant ? 0 : 1)
    if (!rows.rowInvariant) console.warn(`this CPU: int4 batching on onnxruntime's kernel exact to rounding (max difference ${rows.maxDiff})`)
  })

  it("by default, runs shoal's kernel where it builds (bit-exact batching on every CPU), and says why where it does not", () => {
    const int4 = loaded(lines.auto, 'tiny-int4')
    expect(loaded(lines.auto, 'tiny-fp32')).not.toHaveProperty('int4Kernel')
    if (kernelHere) {
      expect(int4).toMatchObject({ int4Kernel: 'shoal', int4Batching: 'bit-exact' })
      expect(lines.auto.filter(l => typeof l.msg === 'string' && l.msg.includes('not to the bit'))).toHaveLength(0)
    } else {
      expect(String(int4?.int4Kernel)).toMatch(/^onnxruntime \(shoal's: /)
      expect(lines.auto.some(l => typeof l.msg === 'string' && l.msg.includes("not shoal's"))).toBe(true)
    }
  })
})
