/**
 * The 'native' decode-attention form (shards/contract.ts DecodeAttentionForm): one DecodeAttention
 * node a layer, run by the fused kernel of daemon/engine/native/ort-kernels.c, which a
 * benchmark preloads (issue 11: what a custom kernel is worth served). It must be exact as the
 * shipped forms are: every test architecture's 64 greedy tokens equal the float64 reference's,
 * its logits stay within float rounding of the per-head form's, and right-padded batches decode
 * bit-identically to each row alone. The kernel is built with the machine's C compiler; without
 * one (`cc`), or off Linux, the test is skipped, as the form is then out of reach anyway. Also
 * checked here: the library loaded into a running process (`process.dlopen`) rather than
 * preloaded gives the op to later sessions too, a process without the kernel refuses the form's
 * graph with onnxruntime's own error, and the kernel's exponential of 16 lanes at once (exp16)
 * gives the bits of its one-value form (exp_neg) on this CPU's vector path and the generic one.
 */
import { execFile } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { buildNativeKernels, hasCompiler, nativeKernelsEnv } from '../../reproduction/lib/native-kernels.ts'
import { compileShards, generateTestModel, NATIVE_KERNEL_DOMAIN } from '../../shards/index.ts'

// The kernel is a Linux shared library (LD_PRELOAD, libonnxruntime.so.1) built with the machine's `cc`.
const compiler = process.platform === 'linux' && await hasCompiler()

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-native-test-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

/** A tiny llama compiled with the 'native' form, made once for the tests that only load it: its stage graph. */
let nativeGraph: Promise<string> | undefined
async function nativeStageGraph (): Promise<string> {
  nativeGraph ??= (async () => {
    const modelDir = join(root, 'model')
    await generateTestModel({ architecture: 'llama', outDir: modelDir, seed: 4 })
    const m = await compileShards({ modelDir, outDir: join(root, 'shards'), opSet: 'ort-contrib', decodeAttention: 'native' })
    expect(m.decodeAttention).toBe('native')
    return join(root, 'shards', m.stages[0]!.graph)
  })()
  return await nativeGraph
}

describe.skipIf(!compiler)('the native decode attention (fused kernel preloaded)', () => {
  it('takes 16 exponentials at once with the bits of one at a time, on every vector path', async () => {
    const builds = process.arch === 'x64' ? [['-march=native'], ['-march=x86-64']] : [['-march=native']]
    const paths: string[] = []
    for (const [i, flags] of builds.entries()) {
      const bin = join(root, `exp-check-${i}`)
      await promisify(execFile)('cc', ['-O3', ...flags, '-o', bin, join(import.meta.dirname, 'native', 'exp-check.c'), '-ldl', '-lm', '-lpthread'])
      const r = JSON.parse((await promisify(execFile)(bin)).stdout) as { path: string, checked: number, differ: number }
      console.log(`exp16 (${r.path}): ${r.checked} values, ${r.differ} differ from exp_neg`)
      expect(r.checked).toBeGreaterThan(100_000_000)
      expect(r.differ, r.path).toBe(0)
      paths.push(r.path)
    }
    if (process.arch === 'x64') expect(paths.at(-1)).toBe('generic')
  })

  it('keeps every architecture\'s reference tokens and batched decode\'s bits', async () => {
    const lib = await buildNativeKernels(join(root, 'lib'))
    const { stdout } = await promisify(execFile)(process.execPath, [join(import.meta.dirname, 'native-attention.child.ts')],
      { env: { ...process.env, ...nativeKernelsEnv(lib) }, maxBuffer: 16 << 20 })
    const results = stdout.trim().split('\n').map(l => JSON.parse(l) as { arch: string, tokens: number[], reference: number[], vsPerHead: number, vsReference: number, batchedMismatches: string[] })
    expect(results.length).toBeGreaterThanOrEqual(4)
    for (const r of results) {
      console.log(`${r.arch} native: max |logit − per-head| ${r.vsPerHead.toExponential(2)}, max |logit − reference| ${r.vsReference.toExponential(2)}`)
      expect(r.tokens, r.arch).toEqual(r.reference)
      expect(r.vsPerHead, r.arch).toBeLessThan(1e-4)
      expect(r.batchedMismatches, r.arch).toEqual([])
    }
  }, 240_000)
})

describe.skipIf(!compiler)('the kernel loaded into a running process (process.dlopen, no preload)', () => {
  it('gives the op to the sessions made after it', async () => {
    const graph = await nativeStageGraph()
    const lib = await buildNativeKernels(join(root, 'lib'))
    // A child of its own: the change stays with the process that loads the library.
    const script = `import ort from 'onnxruntime-node'
const path = process.argv[1]
let before = 'loaded'
try { await ort.InferenceSession.create(path) } catch { before = 'refused' }
process.dlopen({ exports: {} }, process.argv[2])
const s = await ort.InferenceSession.create(path)
console.log(JSON.stringify({ before, after: s.inputNames.length }))`
    const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', script, graph, lib], { cwd: join(import.meta.dirname, '..', '..') })
    const r = JSON.parse(stdout.trim()) as { before: string, after: number }
    expect(r.before).toBe('refused')
    expect(r.after).toBeGreaterThan(0)
  })
})

describe('the native decode attention without the kernel', () => {
  it('is refused when the session is made, naming the op', async () => {
    await expect(ort.InferenceSession.create(await nativeStageGraph())).rejects.toThrow(new RegExp(`DecodeAttention|${NATIVE_KERNEL_DOMAIN.replaceAll('.', '\\.')}`))
  })
})
