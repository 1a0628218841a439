/**
 * The llama.cpp flags that decide what the comparison compares (reproduction/lib/llamacpp.ts):
 * the attention precision per side, the server's context for every prompt of a run, and the
 * ISA flags that keep AMX out where the CPU claims it.
 */
import { describe, expect, it } from 'vitest'
import { isaFlags, kvArgs, llamaServerArgs } from '../../reproduction/lib/llamacpp.ts'

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
})
