import { ExitError } from '../exit-error.ts'

export async function receiptsVerify (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('receipts: not implemented yet')
}

export async function receiptsShow (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('receipts: not implemented yet')
}

