/**
 * The GGUF writer of the llama.cpp comparison (reproduction/gguf.ts): half-float rounding, ggml's
 * reference Q4_0 codes worked out by hand from its definition, the q/k row permutation of
 * convert_hf_to_gguf.py, and the file layout read back field by field.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, expect, it } from 'vitest'
import { f32ToF16, GgmlType, permuteForRope, quantizeQ4_0, Q4_0_BLOCK_BYTES, writeGguf } from '../../reproduction/gguf.ts'

describe('f32ToF16', () => {
  it('rounds to nearest even, with subnormals, overflow and underflow', () => {
    expect(f32ToF16(1)).toBe(0x3c00)
    expect(f32ToF16(-2)).toBe(0xc000)
    expect(f32ToF16(0.1)).toBe(0x2e66)
    expect(f32ToF16(65504)).toBe(0x7bff)
    expect(f32ToF16(65520)).toBe(0x7c00) // rounds up past the largest half
    expect(f32ToF16(2 ** -14)).toBe(0x0400) // smallest normal
    expect(f32ToF16(2 ** -24)).toBe(0x0001) // smallest subnormal
    expect(f32ToF16(2 ** -26)).toBe(0x0000)
    expect(f32ToF16(1 + 2 ** -11)).toBe(0x3c00) // a tie goes to the even mantissa
    expect(f32ToF16(1 + 3 * 2 ** -11)).toBe(0x3c02)
    expect(f32ToF16(-0)).toBe(0x8000)
  })
})

describe('quantizeQ4_0', () => {
  it('takes the signed value of largest magnitude as -8·d and truncates x/d + 8.5, clamped to 15', () => {
    // x = -16 .. 15: max = -16, d = 2, q_j = trunc((j - 16) / 2 + 8.5) = trunc(j/2 + 0.5), the last clamped from 16 to 15.
    const x = Float32Array.from({ length: 32 }, (_, j) => j - 16)
    const out = new Uint8Array(Q4_0_BLOCK_BYTES)
    quantizeQ4_0(x, out)
    expect(out[0]! | (out[1]! << 8)).toBe(0x4000) // d = 2.0 as f16
    const q = (j: number): number => Math.min(15, Math.trunc(j / 2 + 0.5))
    for (let j = 0; j < 16; j++) expect(out[2 + j]).toBe(q(j) | (q(j + 16) << 4))
    expect(out[2 + 15]! >> 4).toBe(15)
  })

  it('writes d = -0 (0 / -8, as in C) and code 8 for an all-zero block (the padded vocabulary rows)', () => {
    const out = new Uint8Array(2 * Q4_0_BLOCK_BYTES)
    quantizeQ4_0(new Float32Array(64), out)
    for (let b = 0; b < 2; b++) {
      expect(out[b * Q4_0_BLOCK_BYTES]! | (out[b * Q4_0_BLOCK_BYTES + 1]! << 8)).toBe(0x8000)
      for (let j = 0; j < 16; j++) expect(out[b * Q4_0_BLOCK_BYTES + 2 + j]).toBe(0x88)
    }
  })

  it('keeps a positive maximum: d is negative and the largest value gets code 0', () => {
    const x = new Float32Array(32)
    x[3] = 4
    x[20] = -2
    const out = new Uint8Array(Q4_0_BLOCK_BYTES)
    quantizeQ4_0(x, out)
    expect(out[0]! | (out[1]! << 8)).toBe(0xb800) // d = -0.5
    expect(out[2 + 3]! & 0xf).toBe(0) // 4 / -0.5 + 8.5 = 0.5 → 0: (0 - 8) · -0.5 = 4
    expect(out[2 + 4]! >> 4).toBe(12) // -2 / -0.5 + 8.5 = 12.5 → 12: (12 - 8) · -0.5 = -2
  })
})

describe('permuteForRope', () => {
  it('moves row p·(hd/2) + j of each head to 2j + p', () => {
    // 2 heads of hd 4, one column: head rows [a0 a1 b0 b1] → [a0 b0 a1 b1].
    const w = Float32Array.from([0, 1, 2, 3, 10, 11, 12, 13])
    expect([...permuteForRope(w, 8, 1, 2)]).toEqual([0, 2, 1, 3, 10, 12, 11, 13])
  })
})

describe('writeGguf', () => {
  it('writes magic, version 3, the KV pairs, tensor infos with aligned offsets, and aligned data', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'shoal-gguf-'))
    try {
      const file = join(dir, 'x.gguf')
      const a = Float32Array.from([1, 2, 3])
      const bytes = await writeGguf(file, [['general.architecture', { type: 'string', value: 'llama' }], ['n', { type: 'u32', value: 7 }]], [
        { name: 'a', dims: [3], type: GgmlType.F32, data: async () => new Uint8Array(a.buffer) },
        { name: 'b', dims: [32, 1], type: GgmlType.Q4_0, data: async () => new Uint8Array(Q4_0_BLOCK_BYTES).fill(0x88) },
      ])
      expect(bytes).toBe(12 + Q4_0_BLOCK_BYTES)
      const buf = await readFile(file)
      let o = 0
      const u32 = (): number => { const v = buf.readUInt32LE(o); o += 4; return v }
      const u64 = (): number => { const v = Number(buf.readBigUInt64LE(o)); o += 8; return v }
      const str = (): string => { const n = u64(); const s = buf.toString('utf8', o, o + n); o += n; return s }
      expect(buf.toString('latin1', 0, 4)).toBe('GGUF'); o = 4
      expect(u32()).toBe(3)
      expect(u64()).toBe(2) // tensors
      expect(u64()).toBe(2) // kv
      expect(str()).toBe('general.architecture'); expect(u32()).toBe(8); expect(str()).toBe('llama')
      expect(str()).toBe('n'); expect(u32()).toBe(4); expect(u32()).toBe(7)
      expect(str()).toBe('a'); expect(u32()).toBe(1); expect(u64()).toBe(3); expect(u32()).toBe(0); expect(u64()).toBe(0)
      expect(str()).toBe('b'); expect(u32()).toBe(2); expect(u64()).toBe(32); expect(u64()).toBe(1); expect(u32()).toBe(2); expect(u64()).toBe(32)
      const data = Math.ceil(o / 32) * 32
      expect(buf.readFloatLE(data + 8)).toBe(3)
      expect(buf[data + 32 + 2]).toBe(0x88)
      expect(buf.length).toBe(data + 32 + Q4_0_BLOCK_BYTES + (32 - Q4_0_BLOCK_BYTES))
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })
})
