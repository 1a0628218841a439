/**
 * The llama.cpp flags that decide what the comparison compares (reproduction/lib/llamacpp.ts):
 * the attention precision per side, the server's context for every prompt of a run, and the
 * ISA flags that keep AMX out where the CPU claims it; llama-batched-bench's flags and rows.
 */
import { describe, expect, it } from 'vitest'
import { isaFlags, kvArgs, llamaBatchedBenchArgs, llamaServerArgs, parseBatchedBench, timedBatchedRows } from '../../reproduction/lib/llamacpp.ts'
import type { BatchedRow } from '../../reproduction/lib/llamacpp.ts'

describe('llama.cpp flags', () => {
  it('keeps llama.cpp defaults unless asked, and f32 attention only beside F32 weights', () => {
    expect(kvArgs('default', 'none')).toEqual([])
    expect(kvArgs('exact', 'none')).toEqual(['-ctk', 'f32', '-ctv', 'f32', '-fa', 'off'])
    expect(kvArgs('exact', 'int4')).toEqual([])
    expect(kvArgs('f16', 'int4')).toEqual(['-ctk', 'f16', '-ctv', 'f16'])
  })

  it('never hands llama-bench an f32 cache, which it refuses', () => {
    expect(kvArgs('exact', 'none', true)).toEqual(['-fa', 'off'])
    expect(kvArgs('f32', 'none', true)).toEqual([])
    expect(kvArgs('f16', 'none', true)).toEqual(['-ctk', 'f16', '-ctv', 'f16'])
  })

  it('sizes the server context for all streams at once or the long prompt, whichever is more', () => {
    const ctx = (a: string[]): number => Number(a[a.indexOf('-c') + 1])
    expect(ctx(llamaServerArgs('m.gguf', 1, { threads: 2, streams: 8, prompt: 128, tokens: 128, long: 2000 }))).toBe(8 * (128 + 128 + 16))
    expect(ctx(llamaServerArgs('m.gguf', 1, { threads: 2, streams: 2, prompt: 128, tokens: 128, long: 2000 }))).toBe(2000 + 128 + 16)
    expect(llamaServerArgs('m.gguf', 8080, { threads: 2, streams: 8, prompt: 128, tokens: 128, long: 2000 })).toEqual(expect.arrayContaining(['--no-cache-prompt', '-cram', '0', '-np', '8', '--port', '8080']))
  })

  it('builds native where no AMX is claimed, and names every extension but AMX where it is', () => {
    expect(isaFlags('flags\t\t: fpu sse4_2 avx avx2\n')).toEqual(['-DGGML_NATIVE=ON'])
    const amx = isaFlags('flags\t\t: fpu sse4_2 avx avx2 fma avx512bw amx_tile amx_int8\n')
    expect(amx).toContain('-DGGML_NATIVE=OFF')
    expect(amx).toContain('-DGGML_AVX2=ON')
    expect(amx).toContain('-DGGML_AVX512=ON')
    expect(amx).toContain('-DGGML_AVX512_VNNI=OFF')
    expect(amx.filter(f => f.startsWith('-DGGML_AMX'))).toEqual(['-DGGML_AMX_TILE=OFF', '-DGGML_AMX_INT8=OFF', '-DGGML_AMX_BF16=OFF'])
  })

  it('sizes llama-batched-bench for its largest row and reads its JSON rows among its other lines', () => {
    const a = llamaBatchedBenchArgs('m.gguf', 2, 128, 128, [1, 8])
    expect(a[a.indexOf('-c') + 1]).toBe(String(8 * 256 + 16))
    expect(a).toEqual(expect.arrayContaining(['-npl', '1,8', '-npp', '128', '-ntg', '128', '--kv-unified', '--output-format', 'jsonl']))
    // A row as llama.cpp de3ff81 prints it, after a log line.
    const out = 'main: n_kv_max = 2304\n' +
      '{"n_kv_max": 2304, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 8, "n_kv": 2048, "t_pp": 0.015832, "speed_pp": 64679.132812, "t_tg": 0.122451, "speed_tg": 8362.528320, "t": 0.138283, "speed": 14810.208008}\n\n'
    expect(parseBatchedBench(out)).toEqual([{ pl: 8, pp: 128, tg: 128, tPp: 0.015832, tTg: 0.122451 }])
    expect(() => parseBatchedBench('{"pl": 8, "pp": 128, "tg": 128, "t_pp": null, "t_tg": 1}')).toThrow(/t_pp/)
    // Cut short at exit: skipped, so the caller sees the row missing and runs it again.
    expect(parseBatchedBench(out + '{"n_kv_max": 2304, "pp": 128, "tg": 128, "pl": 1, "n_')).toHaveLength(1)
  })

  it('drops the warm-up row ahead of the timed ones, and reads a row printed twice once', () => {
    const row = (pl: number, tPp: number): BatchedRow => ({ pl, pp: 128, tg: 128, tPp, tTg: 10 * tPp })
    const warm = row(8, 0.19)
    expect(timedBatchedRows([warm, row(1, 0.02), row(8, 0.18)])).toEqual([row(1, 0.02), row(8, 0.18)])
    // The warm-up row and a timed row of the same B are different rows; a repeat is the same numbers.
    expect(timedBatchedRows([warm, warm, row(1, 0.02), row(1, 0.02), row(8, 0.19)])).toEqual([row(1, 0.02), row(8, 0.19)])
    expect(timedBatchedRows([])).toEqual([])
  })
})
