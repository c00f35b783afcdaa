pub mod ucx;
