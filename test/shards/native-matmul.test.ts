/**
 * shoal's int4 kernel (daemon/engine/native/q4-matmul.h, the MatMulQ4 op of ort-kernels.c; issue
 * 11: a kernel made for a few rows where MLAS's int4 kernel bounds eight streams), on shards whose
 * every int4 product is a MatMulQ4 node (shards/contract.ts Quantization.kernel 'native': what a
 * node with the kernel makes of default shards when it loads them, test/engine/native-kernels.test.ts).
 * Checked:
 * - the kernel against a plain reference that reads MatMulNBits' own layout, bit for bit, on each
 *   of its paths this machine can run (AVX-512 VNNI, AVX-VNNI, AVX2, plain C), all the same bits,
 *   with scales kept as floats and (the vector paths, where every scale is an IEEE half) as halves;
 * - served through onnxruntime, for every test architecture: right-padded batches decode
 *   bit-identically to each row alone; greedy tokens follow MatMulNBits' until a step where
 *   MatMulNBits' own best two logits are closer than the two kernels' logits differ; and the
 *   kernel's logits are as close to the f32-activation graph as MatMulNBits' are (both round
 *   activations to int8 per block of 32, not in the same order);
 * - the compiler refuses the kernel outside int4 'ort-contrib' shards of block 32 at accuracy 4.
 * The kernel is built with the machine's C compiler; without one (`cc`), or off Linux, those tests
 * are skipped.
 */
import { execFile } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { buildNativeKernels, hasCompiler, nativeKernelsEnv } from '../../reproduction/lib/native-kernels.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'

const compiler = process.platform === 'linux' && await hasCompiler()
const run = promisify(execFile)

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-native-matmul-test-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe.skipIf(!compiler)('the native int4 kernel (q4-matmul.h)', () => {
  it('computes the reference\'s bits on every path: AVX-512 VNNI, AVX-VNNI, AVX2, plain C', async () => {
    const source = join(import.meta.dirname, 'native', 'q4-check.c')
    const results: Array<{ path: string, outputs: number, differ: number, hash: string, halves: number, halfScales: number }> = []
    // -march=native takes the widest path this CPU has; on x86 the -mno-… builds take the narrower
    // ones where it has them (an older compiler that lacks a flag skips that build), and baseline
    // x86-64 (no AVX2, no FMA) the plain C one.
    const builds: Array<{ flags: string[], optional?: boolean }> = process.arch !== 'x64'
      ? [{ flags: ['-march=native'] }]
      : [
          { flags: ['-march=native'] },
          { flags: ['-march=native', '-mno-avx512f'], optional: true },
          { flags: ['-march=native', '-mno-avx512f', '-mno-avxvnni'], optional: true },
          { flags: ['-march=x86-64'] },
        ]
    for (const [i, { flags, optional }] of builds.entries()) {
      const bin = join(root, `q4-check-${i}`)
      try {
        await run('cc', ['-O3', ...flags, '-o', bin, source, '-lm'])
      } catch (err) {
        if (optional === true) { console.log(`q4-matmul: no build with ${flags.join(' ')}: ${(err as Error).message.split('\n')[0]}`); continue }
        throw err
      }
      results.push(JSON.parse((await run(bin)).stdout) as { path: string, outputs: number, differ: number, hash: string, halves: number, halfScales: number })
    }
    console.log(`q4-matmul: ${results.map(r => `${r.path} ${r.outputs} outputs, ${r.differ} differ, hash ${r.hash}`).join('; ')}`)
    for (const r of results) {
      expect(r.outputs).toBeGreaterThan(50_000)
      expect(r.differ, r.path).toBe(0)
      expect(r.hash, r.path).toBe(results[0]!.hash)
      // Half the products have scales that are all IEEE halves: the paths that can convert them
      // (AVX-512; AVX2 with F16C, as every AVX2 CPU has) keep them so, the plain one keeps floats.
      expect(r.halves, r.path).toBe(r.halfScales === 1 ? 5 : 0)
      if (r.path === 'avx512-vnni' || r.path === 'plain-c') expect(r.halfScales, r.path).toBe(r.path === 'plain-c' ? 0 : 1)
    }
    if (process.arch === 'x64') expect(results.at(-1)!.path).toBe('plain-c')
  })

  it('serves every architecture as MatMulNBits does, to the int8 activations\' rounding, and batches bit-exactly', async () => {
    const lib = await buildNativeKernels(join(root, 'lib'))
    const { stdout } = await run(process.execPath, [join(import.meta.dirname, 'native-matmul.child.ts')],
      { env: { ...process.env, ...nativeKernelsEnv(lib) }, maxBuffer: 16 << 20 })
    const results = stdout.trim().split('\n').map(l => JSON.parse(l) as {
      arch: string, kernel: string, tokens: number, agree: number, marginAtSplit: number | null,
      vsMatMulNBits: number, matMulNBitsVsF32: number, nativeVsF32: number, batchedMismatches: string[]
    })
    expect(results.length).toBeGreaterThanOrEqual(4)
    for (const r of results) {
      console.log(`${r.arch} MatMulQ4: ${r.agree}/${r.tokens} tokens as MatMulNBits${r.marginAtSplit === null ? '' : ` (its margin there ${r.marginAtSplit.toExponential(2)})`}, max |logit − MatMulNBits| ${r.vsMatMulNBits.toExponential(2)}; against f32 activations: MatMulQ4 ${r.nativeVsF32.toExponential(2)}, MatMulNBits ${r.matMulNBitsVsF32.toExponential(2)}`)
      expect(r.kernel, r.arch).toBe('native')
      expect(r.batchedMismatches, r.arch).toEqual([])
      // The kernels round activations alike but sum in another order: tokens part only at a near tie.
      if (r.marginAtSplit !== null) expect(r.marginAtSplit, r.arch).toBeLessThanOrEqual(2 * r.vsMatMulNBits)
      // No further from MatMulNBits than MatMulNBits' own int8 activations are from f32 ones.
      expect(r.vsMatMulNBits, r.arch).toBeLessThanOrEqual(r.matMulNBitsVsF32)
    }
  }, 300_000)
})

describe('the native int4 kernel in the compiler', () => {
  it('is refused outside int4 \'ort-contrib\' shards of block 32 with int8 activations', async () => {
    const modelDir = join(root, 'model')
    await generateTestModel({ architecture: 'llama', outDir: modelDir, seed: 4 })
    const refused = [
      { quant: 'none' as const },
      { quant: 'int8' as const },
      { quant: 'int4' as const, blockSize: 128 as const },
      { quant: 'int4' as const, accuracyLevel: 0 as const },
      { quant: 'int4' as const, opSet: 'standard' as const },
    ]
    for (const [i, o] of refused.entries()) {
      await expect(compileShards({ modelDir, outDir: join(root, `refused-${i}`), kernel: 'native', ...o }), JSON.stringify(o)).rejects.toThrow(/kernel native/)
    }
  })
})
